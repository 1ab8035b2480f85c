"""Draw RUN/curves.png from RUN/metrics.jsonl: losses and per-depth top-1 accuracy against steps, and, for a
run that validates, the held-out loss beside the training loss and the held-out τ and α per depth."""
from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def split_metrics(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training steps' lines, validation lines): a line without `split` is a training step's."""
    return ([r for r in rows if r.get("split", "train") == "train"],
            [r for r in rows if r.get("split") == "val"])


def draw_curves(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Two panels: total/token/regression loss (log scale) and accuracy per drafting depth; with validation
    lines the held-out total loss joins the first (markers at each validation) and a third panel shows the
    held-out τ and α per depth. A dashed line marks where stage 2 starts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, val = split_metrics(read_metrics(metrics_path))
    fig, axes = plt.subplots(1, 3 if val else 2, figsize=(16 if val else 11, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    steps = [r["step"] for r in rows]
    for key, label in (("loss", "total"), ("token_loss", "soft CE"), ("regression_loss", "SmoothL1")):
        ax_loss.plot(steps, [r[key] for r in rows], label=label, linewidth=1)
    if val:
        ax_loss.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", color="black", markersize=3,
                     linewidth=1, label="held-out total")
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
    if val:
        _draw_acceptance(axes[2], val)
    switch = next((r["step"] for r in rows if r["stage"] == 2), None)
    for ax in axes:
        if switch is not None:
            ax.axvline(switch, color="grey", linestyle="--", linewidth=0.8)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _draw_acceptance(ax, val: list[dict]) -> None:
    """Held-out α_j per depth (left axis, 0..1) and τ (right axis) at each validation."""
    steps = [r["step"] for r in val]
    for j in range(max(len(r["acceptance"]) for r in val)):
        ax.plot(steps, [r["acceptance"][j] if j < len(r["acceptance"]) else None for r in val], "o-",
                markersize=2, linewidth=1, label=f"α{j + 1}")
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_title("held-out offline acceptance")
    tau = ax.twinx()
    tau.plot(steps, [r["tau"] for r in val], "s-", color="black", markersize=3, linewidth=1.5)
    tau.set_ylabel("τ (black)")


def draw_run_curves(run_dir: str | Path) -> Path:
    """RUN/curves.png from RUN/metrics.jsonl (what `train` draws once the drafter is exported)."""
    return draw_curves(Path(run_dir) / "metrics.jsonl", Path(run_dir) / "curves.png")
