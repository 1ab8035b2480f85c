"""The pictures `eval` (and bench/serve.py, through the same JSON) draws of acceptance: per depth and per group.

A rate over few attempts is drawn hatched and pale with its count, never as a full bar among the others:
α3 = 1.00 over four gated drafts is not a rate to compare drafters by (beagle/decoding/evaluation.py,
FEW_ATTEMPTS).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

FULL, ROUGH = "#4c72b0", "#c4cfe3"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)


def plot_acceptance(per_depth: Sequence[float | None], attempts: Sequence[int], path: Path, title: str, *,
                    few: int) -> None:
    """Bars of α_j per draft depth j, each labelled with its rate and its attempts (hatched when < `few`)."""
    plt = _pyplot()
    depths = list(range(1, len(per_depth) + 1))
    figure, axis = plt.subplots(figsize=(5, 3.2))
    for depth, value, tried in zip(depths, per_depth, list(attempts) + [0] * len(depths)):
        rough = 0 < tried < few
        bar = axis.bar(depth, 0.0 if value is None else value, color=ROUGH if rough else FULL,
                       hatch="//" if rough else None, edgecolor=FULL)[0]
        label = "n/a" if value is None else f"{value:.2f}\nn={tried}" + ("*" if rough else "")
        axis.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                      fontsize=7)
    axis.set_xlabel(f"draft depth j (* hatched: fewer than {few} attempts)")
    axis.set_ylabel("acceptance α_j")
    axis.set_ylim(0, 1.2)
    axis.set_xticks(depths)
    axis.set_title(title, fontsize=9)
    _save(figure, path)


def group_chart_path(beside: Path, field: str, infix: str = "") -> Path:
    """Where the by-`field` chart of the JSON report `beside` goes: `<stem>[-infix]-by-<field>.png` next to it.

    The field is a record key the user named (`--by`); anything but letters, digits, '.', '_' and '-' becomes
    '_', so a key like "meta/source" names a file, not a subfolder."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", field) or "_"
    return beside.with_name(f"{beside.stem}{'-' + infix if infix else ''}-by-{safe}.png")


def plot_groups(groups: dict[str, dict], path: Path, title: str, *, few: int) -> None:
    """Per group (MT-Bench category, code, math): α_j as side-by-side bars (hatched when over fewer than `few`
    attempts) and τ above each group. `groups`: name -> the `rates_json` of beagle/decoding/evaluation.py."""
    plt = _pyplot()
    names = list(groups)
    depth = max((len(g["per_depth_acceptance"]) for g in groups.values()), default=0)
    width = 0.8 / max(depth, 1)
    figure, axis = plt.subplots(figsize=(max(5.0, 0.9 * len(names) + 1.5), 3.6))
    shades = plt.get_cmap("Blues")
    for j in range(depth):
        for x, name in enumerate(names):
            rates, tried = groups[name]["per_depth_acceptance"], groups[name]["per_depth_attempts"]
            value = rates[j] if j < len(rates) else None
            n = tried[j] if j < len(tried) else 0
            rough = 0 < n < few
            axis.bar(x - 0.4 + width * (j + 0.5), 0.0 if value is None else value, width,
                     color=ROUGH if rough else shades(0.45 + 0.5 * j / max(depth - 1, 1)),
                     hatch="//" if rough else None, edgecolor=FULL, linewidth=0.5)
    for x, name in enumerate(names):
        axis.annotate(f"τ {groups[name]['acceptance_length']:.2f}", (x, 1.02), ha="center", va="bottom", fontsize=7)
    axis.set_xticks(range(len(names)))
    axis.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    axis.set_ylim(0, 1.15)
    axis.set_ylabel("acceptance α_j")
    axis.set_title(f"{title} (hatched: fewer than {few} attempts)", fontsize=9)
    if depth:  # one swatch per depth in its full colour, outside the bars and the τ labels
        from matplotlib.patches import Patch

        axis.legend(handles=[Patch(color=shades(0.45 + 0.5 * j / max(depth - 1, 1)), label=f"α{j + 1}")
                             for j in range(depth)], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(figure, path)
