"""Fused multi-layer keys against last-layer keys (not a test), Beagle and the EAGLE-2 baseline side by side.

One run on the demo target: extract ShareGPT conversations with several layers captured (training store)
and other conversations (held-out store), train four drafters for the same steps through the real CLI
(Beagle and EAGLE-2, each with last-layer keys and with fused keys, all from the same training store), and
score them by the same offline chain acceptance (bench/acceptance.py) on the held-out store. Prints τ,
per-depth acceptance, fused ÷ last for each drafter, Beagle ÷ EAGLE-2 for each input (P5), and the store
bytes per token that each captured layer costs.

    python bench/layers.py [--quick] [--layers 2,15,27,-1] [--steps 300,1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import score_drafter  # noqa: E402
from bench.common import DEMO_MODEL, DEMO_SHAREGPT, cli, emit, record, require_demo  # noqa: E402
from bench.quality import DRAFT_VOCAB, train  # noqa: E402
from bench.quality import _bytes as store_bytes  # noqa: E402
from beagle.data import StoreSet  # noqa: E402


def _split_conversations(workdir: Path, train: int, held_out: int) -> tuple[Path, Path]:
    """The first `train` ShareGPT lines, and the `held_out` lines after them, as two input files."""
    lines = DEMO_SHAREGPT.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 may sit inside a record
    first, second = workdir / "train.jsonl", workdir / "held_out.jsonl"
    first.write_text("\n".join(lines[:train]) + "\n", encoding="utf-8")
    second.write_text("\n".join(lines[train:train + held_out]) + "\n", encoding="utf-8")
    return first, second


def _extract(data: Path, out: Path, layers: str, max_length: int) -> None:
    if (out / "manifest.json").is_file():
        return
    cli("extract", "--model", str(DEMO_MODEL), "--data", str(data), "--out", str(out), "--layers", layers,
        "--max-length", str(max_length), "--dtype", "bfloat16", "--no-progress")


def _train(store: Path, out: Path, drafter: str, fused: bool, steps: int, batch_tokens: int, max_length: int,
           *extra: str) -> Path:
    """bench/quality.py's training recipe, with last-layer or fused keys."""
    return Path(train(str(store), str(out), drafter, steps, batch_tokens, max_length,
                      "--fuse-layers" if fused else "--no-fuse-layers", *extra))


def score(drafter_dir: Path, held_out: Path, head: dict, max_length: int) -> tuple[float, list[float]]:
    """(τ, α per depth) of an exported drafter: offline chain acceptance (depth 5) over every sample of the
    held-out store, drafting over the drafter's trained vocabulary."""
    return score_drafter(str(drafter_dir), str(held_out), head, samples=len(StoreSet([str(held_out)])),
                         limit=max_length)


def _bytes_per_token(store: Path) -> float:
    """Bytes on disk per token, the per-store head excluded."""
    return store_bytes(str(store)) / int(StoreSet([str(store)]).lengths.sum())


def _records(scores: dict[str, tuple[float, list[float]]], settings: dict) -> list[dict]:
    """P5 (Beagle ÷ EAGLE-2) and P10 (fused ÷ last) from the four drafters' scores at one number of steps."""
    steps = settings["steps"]
    tau = {name: value[0] for name, value in scores.items()}
    alphas = {name: [round(a, 2) for a in value[1]] for name, value in scores.items()}
    return [
        record("P5", f"τ Beagle ÷ τ EAGLE-2, last-layer keys, {steps} steps", tau["beagle-last"] / tau["eagle2-last"],
               1.0, ">=", f"τ {tau['beagle-last']:.3f} vs {tau['eagle2-last']:.3f}; α {alphas['beagle-last']} vs "
               f"{alphas['eagle2-last']}", settings, why="see docs/training.md, the depth-1 gap"),
        record("P5", f"τ Beagle ÷ τ EAGLE-2, fused keys, {steps} steps", tau["beagle-fused"] / tau["eagle2-fused"],
               1.0, ">=", f"τ {tau['beagle-fused']:.3f} vs {tau['eagle2-fused']:.3f}; α {alphas['beagle-fused']} vs "
               f"{alphas['eagle2-fused']}", settings, why="see docs/training.md, the depth-1 gap"),
        record("P10", f"τ fused ÷ τ last-layer keys, Beagle, {steps} steps", tau["beagle-fused"] / tau["beagle-last"],
               1.0, ">=", f"τ {tau['beagle-fused']:.3f} vs {tau['beagle-last']:.3f}", settings,
               why="fusion adds what the other layers know; at this budget it is not yet worth their store cost"),
        record("P10", f"τ fused ÷ τ last-layer keys, EAGLE-2, {steps} steps", tau["eagle2-fused"] / tau["eagle2-last"],
               1.0, ">=", f"τ {tau['eagle2-fused']:.3f} vs {tau['eagle2-last']:.3f}", settings,
               why="fusion adds what the other layers know; at this budget it is not yet worth their store cost"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few conversations and steps")
    parser.add_argument("--layers", default="2,15,27,-1", help="layers captured and fused (HF hidden_states indices)")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--steps", default=None,
                        help="training steps, comma-separated: every drafter is trained and scored at each "
                             "[300,1000; --quick: 20]")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_demo()
    conversations = args.conversations or (24 if args.quick else 400)
    steps_list = [int(n) for n in (args.steps or ("20" if args.quick else "300,1000")).split(",")]
    batch_tokens, max_length = (512, 256) if args.quick else (2048, 512)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-layers-"))
    work.mkdir(parents=True, exist_ok=True)
    train_data, held_out_data = _split_conversations(work, conversations, max(8, conversations // 10))
    _extract(train_data, work / "train-store", args.layers, max_length)
    _extract(held_out_data, work / "held-out-store", args.layers, max_length)
    head = StoreSet([str(work / "train-store")]).load_head()
    layers = [int(x) for x in args.layers.split(",")]
    per_token = _bytes_per_token(work / "train-store")
    train_tokens = int(StoreSet([str(work / "train-store")]).lengths.sum())
    records: list[dict] = []
    scores_by_steps: dict[int, dict] = {}
    for steps in steps_list:
        scores = {}
        for drafter in ("beagle", "eagle2"):
            for fused in (False, True):
                name = f"{drafter}-{'fused' if fused else 'last'}"
                path = _train(work / "train-store", work / f"run-{name}-{steps}", drafter, fused, steps,
                              batch_tokens, max_length)
                scores[name] = score(path, work / "held-out-store", head, max_length)
                print(f"{name} at {steps} steps: tau {scores[name][0]:.3f} "
                      f"alpha {[round(a, 3) for a in scores[name][1]]}", flush=True)
        settings = {"layers": layers, "conversations": conversations, "steps": steps, "batch_tokens": batch_tokens,
                    "max_length": max_length, "draft_vocab": DRAFT_VOCAB, "lr": 1e-3,
                    "train_tokens": train_tokens,
                    "eval": "offline chain depth 5 on the held-out store", "store_bytes_per_token": round(per_token),
                    "per_layer_bytes_per_token": round(per_token / len(layers))}
        records += _records(scores, settings)
        scores_by_steps[steps] = {"scores": scores, "settings": settings}
    (work / "scores.json").write_text(json.dumps(scores_by_steps, indent=2))  # {steps: {scores, settings}}
    emit(records, args.json)


if __name__ == "__main__":
    main()
