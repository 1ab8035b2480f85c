"""The levers of the engine-form Beagle, one at a time, held out (not a test): which settings raise τ.

    python bench/levers.py --answers runs/peer/answers.jsonl [--steps 300] [--workdir runs/levers]
                           [--only baseline,cosine] [--json out.json]

The data is self-distilled, as the demo's and bench/peer.py's: the target's own answers (`regenerate`) split
into a training store (the first 90% of the conversations) and a held-out store (the rest), both extracted
with `extract`'s default layers. Each lever is one `beagle-pipeline train --residual state` run from the
demo's recipe (lr 1e-3, 20 warm-up steps, an 8,192-token draft vocabulary, keys from EAGLE-3's three aux
layers) with one change, trained for the same steps and tokens per step, then scored by the same offline
chain acceptance (bench/acceptance.py, depth 5) on the held-out store: τ and α per depth. Scores are
appended to `--workdir`/scores.jsonl as they come, so a rerun resumes; a benchmark measures, it asserts
nothing.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO_MODEL, ROOT, cli, emit, record, require_demo  # noqa: E402
from bench.layers import score  # noqa: E402
from beagle.data import StoreSet, plan_epoch  # noqa: E402

BASE = ["--residual", "state", "--lr", "1e-3", "--warmup-steps", "20", "--draft-vocab", "8192"]
LEVERS: dict[str, list[str]] = {
    "baseline": [],                                              # three aux keys, k = 5, s = 4, constant lr
    "one-key-27": ["--key-layers", "27"],                        # the deepest aux layer alone
    "cosine": ["--lr-schedule", "cosine"],                       # decay to 0 at the last step
    "linear": ["--lr-schedule", "linear"],
    "ttt-3": ["--window-size", "3", "--simulation-steps", "3"],  # trained depth = the k the engine serves
    "lr-3e-3": ["--lr", "3e-3"],
    "query-state": ["--query-state"],                            # EAGLE-3's q over [embedding, state]
    "stage2-from-start": ["--stage1-epochs", "0"],               # TTT from the first step, as speculators trains
    "ttt-3-from-start": ["--window-size", "3", "--simulation-steps", "3", "--stage1-epochs", "0"],
    "no-regression": ["--regression-weight", "0"],               # token loss only (speculators: KL alone)
    "no-noise": ["--noise-std", "0"],                            # no key noise (speculators adds none)
    "init-target": ["--init-from-target", str(DEMO_MODEL)],      # the block starts as the target's last layer
    "init-target-ttt-3": ["--init-from-target", str(DEMO_MODEL), "--window-size", "3", "--simulation-steps", "3"],
    "init-target-from-start": ["--init-from-target", str(DEMO_MODEL), "--stage1-epochs", "0"],
    "init-target-ttt-3-from-start": ["--init-from-target", str(DEMO_MODEL), "--window-size", "3",
                                     "--simulation-steps", "3", "--stage1-epochs", "0"],
    "weight-decay-0.1": ["--weight-decay", "0.1"],              # held-out α1 trails training's: regularise
    "init-target-ttt-3-no-regression": ["--init-from-target", str(DEMO_MODEL), "--window-size", "3",
                                        "--simulation-steps", "3", "--regression-weight", "0"],
}


def split_answers(answers: Path, work: Path, held_out_share: float = 0.1) -> tuple[Path, Path]:
    lines = [line for line in answers.read_text(encoding="utf-8").split("\n") if line.strip()]
    cut = int(len(lines) * (1 - held_out_share))
    first, second = work / "train.jsonl", work / "held_out.jsonl"
    first.write_text("\n".join(lines[:cut]) + "\n", encoding="utf-8")
    second.write_text("\n".join(lines[cut:]) + "\n", encoding="utf-8")
    return first, second


def extract(data: Path, out: Path, max_length: int) -> None:
    if not (out / "manifest.json").is_file():
        cli("extract", "--model", str(DEMO_MODEL), "--data", str(data), "--out", str(out),
            "--max-length", str(max_length), "--dtype", "bfloat16", "--no-progress")


def stage_epochs(store: Path, steps: int, batch_tokens: int, max_length: int) -> list[str]:
    """Stage 1 for about two thirds of `steps` (the demo's 8:4 epochs), stage 2 until `--max-steps`."""
    per_epoch = len(plan_epoch(StoreSet([str(store)]).lengths, batch_tokens=batch_tokens, limit=max_length,
                               seed=0, epoch=0))
    return ["--stage1-epochs", str(max(1, round(2 * steps / 3 / per_epoch))), "--stage2-epochs", "1000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", default=str(ROOT / "runs" / "peer" / "answers.jsonl"),
                        help="the target's own answers (regenerate's output)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--only", default=None, help=f"comma-separated levers of {list(LEVERS)}")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "levers"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_demo()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    train_data, held_out_data = split_answers(Path(args.answers), work)
    extract(train_data, work / "train-store", args.max_length)
    extract(held_out_data, work / "held-out-store", args.max_length)
    head = StoreSet([str(work / "train-store")]).load_head()
    scores_path = work / "scores.jsonl"
    done = {}
    if scores_path.is_file():
        done = {(r["name"], r["steps"]): r for r in map(json.loads, scores_path.read_text().splitlines()) if r}
    split = stage_epochs(work / "train-store", args.steps, args.batch_tokens, args.max_length)
    names = args.only.split(",") if args.only else list(LEVERS)
    for name in names:
        if (name, args.steps) in done:
            continue
        run = work / f"run-{name}-{args.steps}"
        shutil.rmtree(run, ignore_errors=True)  # this script's own earlier run of the lever
        flags = [*BASE, *split, *LEVERS[name]]
        cli("train", "--store", str(work / "train-store"), "--out", str(run), "--max-steps", str(args.steps),
            "--batch-tokens", str(args.batch_tokens), "--max-length", str(args.max_length), "--no-progress", *flags)
        tau, alphas = score(run / "drafter", work / "held-out-store", head, args.max_length)
        done[(name, args.steps)] = row = {"name": name, "steps": args.steps, "tau": tau, "alphas": alphas,
                                          "flags": flags}
        with scores_path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
        print(f"{name}: τ {tau:.3f} α {[round(a, 3) for a in alphas]}", flush=True)
    base = done.get(("baseline", args.steps))
    records = []
    for name in names:
        row = done[(name, args.steps)]
        print(f"{name:12s} τ {row['tau']:.3f}  α {[round(a, 3) for a in row['alphas']]}")
        if base and name != "baseline":
            records.append(record("L", f"τ {name} ÷ τ baseline, engine form, {args.steps} steps",
                                  row["tau"] / base["tau"], 1.0, ">=",
                                  f"τ {row['tau']:.3f} vs {base['tau']:.3f}", {"flags": row["flags"]},
                                  why="this lever does not help here"))
    emit(records, args.json)


if __name__ == "__main__":
    main()
