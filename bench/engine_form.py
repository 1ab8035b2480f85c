"""The engine-form Beagle against the paper's form and EAGLE-2 (not a test): P5 held out, equal steps.

One run on the demo target: extract ShareGPT conversations with the residual-stream layers an engine hands an
EAGLE-3 drafter plus the last layer (training store) and other conversations (held-out store); train, for each
of `--steps`, through the real CLI and from the same store:

    beagle-last          Beagle, embedding residual, keys from layer -1 (after the final norm)
    beagle-state-last    Beagle, state residual (`--residual state`), keys from the last decoder layer's input
                         (the last-layer equivalent an engine can hand over)
    beagle-state-query-last  the same with queries that also read the previous state (`--query-state`)
    eagle2-last          the EAGLE-2 baseline on layer -1
    beagle-fused, beagle-state-fused, eagle2-fused: the same, keys from every captured layer

Both Beagle forms train stage 1 for about half the steps (whole epochs) and stage 2 for the rest; EAGLE-2
trains teacher-forced throughout. All are scored by the same offline chain acceptance (bench/acceptance.py,
depth 5) on the held-out store, drafting over each one's trained vocabulary. Prints τ, α per depth and
engine-form ÷ EAGLE-2 (P5 for the engine form), engine-form ÷ paper-form, and writes every score as it goes
(`--workdir`/scores.jsonl), so a rerun with the same workdir resumes.

    python bench/engine_form.py [--quick] [--layers 2,15,27,29,-1] [--steps 300,1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, record, require_demo  # noqa: E402
from bench.layers import _extract, _split_conversations, score  # noqa: E402
from bench.quality import train  # noqa: E402
from beagle.data import StoreSet, plan_epoch  # noqa: E402
from beagle.registry import form_for  # noqa: E402

LAST_ONLY = ("beagle-last", "beagle-state-last", "beagle-state-query-last", "eagle2-last")


def _drafters(layers: list[int]) -> dict[str, tuple[str, list[str]]]:
    """{name: (--drafter, extra flags)}; the state form's last-layer equivalent is the deepest captured input."""
    aux = [layer for layer in layers if layer != -1]
    return {
        "beagle-last": ("beagle", ["--no-fuse-layers"]),
        "beagle-state-last": ("beagle", ["--residual", "state", "--key-layers", str(max(aux))]),
        "beagle-state-query-last": ("beagle", ["--residual", "state", "--query-state", "--key-layers", str(max(aux))]),
        "eagle2-last": ("eagle2", ["--no-fuse-layers"]),
        "beagle-fused": ("beagle", ["--fuse-layers"]),
        "beagle-state-fused": ("beagle", ["--residual", "state", "--key-layers", ",".join(map(str, aux))]),
        "eagle2-fused": ("eagle2", ["--fuse-layers"]),
    }


def _stage_split(store: Path, steps: int, batch_tokens: int, max_length: int) -> list[str]:
    """Stage-1 epochs covering about half of `steps`, then stage 2 until `--max-steps` stops it."""
    lengths = StoreSet([str(store)]).lengths
    per_epoch = len(plan_epoch(lengths, batch_tokens=batch_tokens, limit=max_length, seed=0, epoch=0))
    return ["--stage1-epochs", str(max(1, math.ceil(steps / 2 / per_epoch))), "--stage2-epochs", "1000"]


def _done(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {f"{r['name']}@{r['steps']}": r for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few conversations and steps")
    parser.add_argument("--layers", default="2,15,27,29,-1", help="layers captured (HF hidden_states indices)")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--steps", default=None, help="training steps, comma-separated [300,1000; --quick: 20]")
    parser.add_argument("--fused-steps", default=None,
                        help="steps at which the fused drafters are trained too [the first of --steps]")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_demo()
    conversations = args.conversations or (24 if args.quick else 400)
    steps_list = [int(n) for n in (args.steps or ("20" if args.quick else "300,1000")).split(",")]
    fused_steps = {int(n) for n in (args.fused_steps or str(steps_list[0])).split(",")}
    batch_tokens, max_length = (512, 256) if args.quick else (2048, 512)
    layers = [int(x) for x in args.layers.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-engine-form-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}", flush=True)
    train_data, held_out_data = _split_conversations(work, conversations, max(8, conversations // 10))
    _extract(train_data, work / "train-store", args.layers, max_length)
    _extract(held_out_data, work / "held-out-store", args.layers, max_length)
    head = StoreSet([str(work / "train-store")]).load_head()
    scores_path = work / "scores.jsonl"
    done = _done(scores_path)
    records: list[dict] = []
    for steps in steps_list:
        split = _stage_split(work / "train-store", steps, batch_tokens, max_length)
        scores: dict[str, tuple[float, list[float]]] = {}
        for name, (drafter, extra) in _drafters(layers).items():
            if name not in LAST_ONLY and steps not in fused_steps:
                continue
            key = f"{name}@{steps}"
            if key not in done:
                flags = [*extra, *(split if form_for(drafter, "embedding").simulates else [])]  # stage-2 split
                path = Path(train(str(work / "train-store"), str(work / f"run-{name}-{steps}"), drafter, steps,
                                  batch_tokens, max_length, *flags))
                tau, alphas = score(path, work / "held-out-store", head, max_length)
                done[key] = {"name": name, "steps": steps, "tau": tau, "alphas": alphas, "flags": flags}
                with scores_path.open("a") as out:
                    out.write(json.dumps(done[key]) + "\n")
            scores[name] = (done[key]["tau"], done[key]["alphas"])
            print(f"{name} at {steps} steps: tau {scores[name][0]:.3f} "
                  f"alpha {[round(a, 3) for a in scores[name][1]]}", flush=True)
        settings = {"layers": layers, "conversations": conversations, "steps": steps, "batch_tokens": batch_tokens,
                    "max_length": max_length, "lr": 1e-3, "beagle_stages": " ".join(split),
                    "eval": "offline chain depth 5 on the held-out store"}
        for keys in ("last", "fused"):
            state, paper, eagle = (f"beagle-state-{keys}", f"beagle-{keys}", f"eagle2-{keys}")
            if state not in scores:
                continue
            tau = {n: scores[n][0] for n in (state, paper, eagle)}
            records.append(record("P5", f"τ engine-form Beagle ÷ τ EAGLE-2, {keys} keys, {steps} steps",
                                  tau[state] / tau[eagle], 1.0, ">=",
                                  f"τ {tau[state]:.3f} vs {tau[eagle]:.3f} (paper form {tau[paper]:.3f})", settings,
                                  why="see docs/training.md, the engine form"))
            records.append(record("P5b", f"τ engine-form ÷ τ paper-form Beagle, {keys} keys, {steps} steps",
                                  tau[state] / tau[paper], 1.0, ">=", f"τ {tau[state]:.3f} vs {tau[paper]:.3f}",
                                  settings, why="the state residual does not pay here"))
    emit(records, args.json)


if __name__ == "__main__":
    main()
