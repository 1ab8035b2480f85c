"""Where Beagle's depth-1 acceptance goes (not a test): training rows at depth 1, what the states add, and the
weight of the regression loss.

Three measurements on the stores and drafters of a finished bench/layers.py run, all scored on its held-out
store (τ by the offline chain of bench/acceptance.py, α1 of other guessers by the same chain's depth-1 rule):
- **Rows at depth 1.** EAGLE-2 trains every row at depth 1 (teacher-forced); Beagle's stage 1 trains each
  row at its depth in its window of k, so only 1/k of its rows teach depth 1. Beagle is retrained with
  windows k = 1 and 2 (`--windows`): if α1 rises past EAGLE-2's as k falls, the gap is the split of the
  training signal, not the architecture.
- **What the states add.** α1 of a bigram table counted on the training store (what a drafter that reads
  only its query token could learn there), and of the Beagle (k = 5) drafter with its keys made from the
  store's mean state or from another sample's states instead of the true ones.
- **The regression weight** (`--regression-weights`, default 0,1; the method's is 10): Beagle retrained
  with a lighter or no SmoothL1 term next to the token loss.

    python bench/depth1.py --workdir runs/bench-layers [--windows 1,2] [--regression-weights 0,1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import beagle_depth1_predictor, bigram_predictor, depth1_acceptance  # noqa: E402
from bench.common import emit, record  # noqa: E402
from bench.layers import _train, score  # noqa: E402
from beagle.data import StoreSet, collate  # noqa: E402
from beagle.drafter_folder import load_drafter  # noqa: E402


def mean_state(store: str, limit: int, samples: int = 64) -> torch.Tensor:
    """The mean last-layer state [d] over up to `samples` samples spread through `store`."""
    data = StoreSet([store])
    picks = range(0, len(data), max(1, len(data) // samples))
    states = torch.cat([data.sample(i, limit)[2].double() for i in picks])                # [N, d]
    return states.mean(0).float()


def what_the_states_add(work: Path, steps: int, max_length: int) -> dict[str, float]:
    """α1 on the held-out store: a bigram table of the training store, and the Beagle (k = 5) drafter of the
    bench/layers.py run with true, mean-state and another sample's keys."""
    held_out, train = str(work / "held-out-store"), str(work / "train-store")
    head = StoreSet([train]).load_head()
    model, meta = load_drafter(work / f"run-beagle-last-{steps}" / "drafter",
                               embed_tokens=head["embed_tokens"].float(), lm_head=head["lm_head"].float())
    vocab = torch.tensor(meta["draft_vocab"]) if meta.get("draft_vocab") else None
    mean = mean_state(train, max_length)
    others = StoreSet([held_out])

    def foreign(index: int, batch) -> torch.Tensor:  # the next held-out sample's states, then the mean: [1, L, d]
        L = batch.hidden.shape[1]
        other = collate([others.sample((index + 1) % len(others), L)]).hidden
        keys = mean.expand(1, L, -1).clone()
        keys[:, :other.shape[1]] = other
        return keys

    return {
        "bigram table (training store)": depth1_acceptance(bigram_predictor(train, limit=max_length), held_out,
                                                           limit=max_length),
        "beagle k=5, true keys": depth1_acceptance(beagle_depth1_predictor(model, vocab), held_out, limit=max_length),
        "beagle k=5, mean-state keys": depth1_acceptance(
            beagle_depth1_predictor(model, vocab, lambda i, b: mean.expand_as(b.hidden).clone()), held_out,
            limit=max_length),
        "beagle k=5, another sample's keys": depth1_acceptance(beagle_depth1_predictor(model, vocab, foreign),
                                                               held_out, limit=max_length),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the --workdir of a finished bench/layers.py run")
    parser.add_argument("--windows", default="1,2", help="Beagle windows k to retrain with ('' for none)")
    parser.add_argument("--regression-weights", default="0,1",
                        help="Beagle (k = 5) regression weights to retrain with ('' for none)")
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
    for k in (int(x) for x in args.windows.split(",") if x):
        path = _train(work / "train-store", work / f"run-beagle-k{k}-{steps}", "beagle", False, steps, batch_tokens,
                      max_length, "--window-size", str(k), "--simulation-steps", str(k))
        scores[f"beagle k={k}"] = score(path, held_out, head, max_length)
    for weight in (float(x) for x in args.regression_weights.split(",") if x):
        path = _train(work / "train-store", work / f"run-beagle-reg{weight:g}-{steps}", "beagle", False, steps,
                      batch_tokens, max_length, "--regression-weight", str(weight))
        scores[f"beagle k=5, regression weight {weight:g}"] = score(path, held_out, head, max_length)
    for name, (tau, alphas) in scores.items():
        print(f"{name}: tau {tau:.3f} alpha {[round(a, 3) for a in alphas]}", flush=True)
    parts = what_the_states_add(work, steps, max_length)
    for name, alpha1 in parts.items():
        print(f"depth 1, {name}: alpha1 {alpha1:.3f}", flush=True)
    alpha1 = {name: alphas[0] for name, (_, alphas) in scores.items()}
    best = max((name for name in scores if name.startswith("beagle")), key=lambda name: alpha1[name])
    emit([record("P5", "α1 best Beagle variant ÷ α1 EAGLE-2", alpha1[best] / alpha1["eagle2"],
                 1.0, ">=", "; ".join(f"{name}: α1 {a:.3f}, τ {scores[name][0]:.3f}" for name, a in alpha1.items()),
                 {**settings, "windows": args.windows, "regression_weights": args.regression_weights,
                  "depth1_parts": {name: round(a, 4) for name, a in parts.items()}},
                 why="see docs/training.md, the depth-1 gap")], args.json)
    (work / "depth1.json").write_text(json.dumps({"scores": scores, "depth1_parts": parts}, indent=2))


if __name__ == "__main__":
    main()
