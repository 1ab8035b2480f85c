"""Draw RUN/curves.png from RUN/metrics.jsonl: losses and per-depth top-1 accuracy against steps."""
from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def draw_curves(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Two panels: total/token/regression loss (log scale) and accuracy per drafting depth.
    A dashed line marks where stage 2 starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    for key, label in (("loss", "total"), ("token_loss", "soft CE"), ("regression_loss", "SmoothL1")):
        ax_loss.plot(steps, [r[key] for r in rows], label=label, linewidth=1)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("loss")
    depths = max((len(r["accuracy"]) for r in rows), default=0)
    for j in range(depths):
        points = [(r["step"], r["accuracy"][j]) for r in rows if r["accuracy"][j] is not None]
        if points:
            xs, ys = zip(*points)
            ax_acc.plot(xs, ys, label=f"depth {j + 1}", linewidth=1)
    ax_acc.set_ylim(0, 1)
    ax_acc.set_xlabel("step")
    ax_acc.set_title("top-1 agreement with the target")
    switch = next((r["step"] for r in rows if r["stage"] == 2), None)
    for ax in (ax_loss, ax_acc):
        if switch is not None:
            ax.axvline(switch, color="grey", linestyle="--", linewidth=0.8)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
