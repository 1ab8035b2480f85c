"""Where Beagle's depth-1 acceptance goes (not a test): the share of training rows at depth 1.

EAGLE-2 trains every row at depth 1 (teacher-forced). Beagle's stage 1 tiles the sequence into windows of
k and trains each row at its depth in its window, so only 1/k of its rows train depth 1; at equal steps it
sees k times fewer depth-1 examples. This run trains Beagle with windows k = 1 and 2 (all, or half, of its
rows at depth 1) for the steps bench/layers.py used, on its training store, and scores them on its held-out
store beside the Beagle (k = 5) and EAGLE-2 drafters bench/layers.py trained: if α1 rises towards or past
EAGLE-2's as k falls, the gap is the split of the training signal, not the architecture.

    python bench/depth1.py --workdir runs/bench-layers [--windows 1,2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, record  # noqa: E402
from bench.layers import _train, score  # noqa: E402
from beagle.data import StoreSet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the --workdir of a finished bench/layers.py run")
    parser.add_argument("--windows", default="1,2")
    parser.add_argument("--steps", type=int, default=None, help="which of its numbers of steps (default: the first)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = Path(args.workdir)
    runs = json.loads((work / "scores.json").read_text())  # {steps: {scores, settings}}
    settings = runs[str(args.steps) if args.steps else next(iter(runs))]["settings"]
    steps, batch_tokens, max_length = settings["steps"], settings["batch_tokens"], settings["max_length"]
    held_out = work / "held-out-store"
    head = StoreSet([str(work / "train-store")]).load_head()
    scores = {"eagle2": score(work / f"run-eagle2-last-{steps}" / "drafter", held_out, head, max_length),
              "beagle k=5": score(work / f"run-beagle-last-{steps}" / "drafter", held_out, head, max_length)}
    for k in (int(x) for x in args.windows.split(",")):
        path = _train(work / "train-store", work / f"run-beagle-k{k}-{steps}", "beagle", False, steps, batch_tokens,
                      max_length, "--window-size", str(k), "--simulation-steps", str(k))
        scores[f"beagle k={k}"] = score(path, held_out, head, max_length)
    for name, (tau, alphas) in scores.items():
        print(f"{name}: tau {tau:.3f} alpha {[round(a, 3) for a in alphas]}", flush=True)
    alpha1 = {name: alphas[0] for name, (_, alphas) in scores.items()}
    best = max((name for name in scores if name.startswith("beagle")), key=lambda name: alpha1[name])
    emit([record("P5", "α1 Beagle (k with the most depth-1 rows) ÷ α1 EAGLE-2", alpha1[best] / alpha1["eagle2"],
                 1.0, ">=", "; ".join(f"{name}: α1 {a:.3f}, τ {scores[name][0]:.3f}" for name, a in alpha1.items()),
                 {**settings, "windows": args.windows},
                 why="see docs/training.md, the depth-1 gap")], args.json)
    (work / "depth1.json").write_text(json.dumps(scores, indent=2))


if __name__ == "__main__":
    main()
