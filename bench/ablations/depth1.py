"""Runner of the depth-1 ablations in docs/training.md ("Ablations of the depth-1 gap"); not a test.

The ablations change the model through a temporary patch that is not in the code base. To rerun one, in
a scratch clone at the commit the patch was written against:

    git clone -q <repo> /tmp/ablate && cd /tmp/ablate && git checkout -q 58f6132
    cp -r <repo>/bench/ablations bench/      # 58f6132 predates these files
    git apply bench/ablations/depth1.patch
    EXP_KV_HEADS=9 python bench/ablations/depth1.py mha beagle 300 --store STORE
    python bench/ablations/depth1.py k1 beagle 300 --store STORE -- --window-size 1 --simulation-steps 1

Switches of the patch (environment variables, unset = the default model): EXP_KV_HEADS=N (KV heads),
EXP_STAGE1_BETA=1 (stage-1 rows weighted by β per depth), EXP_ALIBI=T (ALiBi slopes 2^(-T·h/H); -30 puts
every head on the newest visible key), EXP_DEPTH=1 (a learned depth embedding on the query),
EXP_XGAIN=G (a learned gain, initialised to G, on the token embedding in the residual), EXP_KEYTOK=1
(keys hold RMSNorm(h_j) + RMSNorm(Emb(t_j))).

Each run trains as bench/quality.py does (300 steps of 2,048 tokens, stage 1, lr 1e-3, draft vocabulary
8,192), scores the drafter with bench/acceptance.py (offline chain of 5 on the store's first 32 samples,
which it also trains on) and appends one JSON line to <workdir>/results.jsonl. In
bench/ablations/depth1-results.jsonl the lines with a "scoring" field were scored held out instead (the
split bench/quality.py makes).

Second round, scored held out (docs/training.md, "Held out, second round"): `--held-out STORE` scores on
every sample of that store instead, here the training and held-out stores of a bench/layers.py run. Its
model switches are in bench/ablations/depth1-round2.patch, written against commit 7384a74: EXP_MLP=N (MLP
width), EXP_ZEROINIT=1 (o_proj and the MLP's down projection start at zero), EXP_QBIAS=1 (a learned bias on
the queries), EXP_CENTER=FILE (keys made from h - μ, μ a [d] tensor saved with torch.save, e.g.
bench/depth1.py's `mean_state` of the training store). The other rows need only `train` flags (--lr,
--noise-std, --warmup-steps, --seed, --regression-weight); every line is in
bench/ablations/depth1-round2-results.jsonl (its `--config regW.json` held {"regression_weight": W}, W = 1,
0.1 for "01", 0; the flag came after those runs).

    python bench/ablations/depth1.py reg0 beagle 300 --store runs/bench-layers/train-store \
        --held-out runs/bench-layers/held-out-store -- --no-fuse-layers --regression-weight 0
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.acceptance import score_drafter  # noqa: E402
from bench.quality import train  # noqa: E402
from beagle.data import StoreSet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the run's name (its folder under --workdir)")
    parser.add_argument("drafter", choices=["beagle", "eagle2"])
    parser.add_argument("steps", type=int)
    parser.add_argument("--store", required=True, help="a bf16 store of the demo model (bench/extract.py's P1 store)")
    parser.add_argument("--held-out", default=None, help="score on every sample of this store instead of the "
                                                            "training store's first 32")
    parser.add_argument("--workdir", default="runs/ablations/depth1")
    parser.add_argument("train_flags", nargs="*", help="extra `train` flags, after --")
    args = parser.parse_args()
    started = time.time()
    drafter_dir = train(args.store, f"{args.workdir}/{args.name}", args.drafter, args.steps, 2048, 512,
                        *args.train_flags)
    head = StoreSet([args.store]).load_head()
    scored_on = args.held_out or args.store
    samples = len(StoreSet([args.held_out])) if args.held_out else 32
    tau, alpha = score_drafter(drafter_dir, scored_on, head, samples=samples, limit=512)
    line = {"name": args.name, "drafter": args.drafter, "steps": args.steps, "tau": round(tau, 4),
            "alpha": [round(a, 3) for a in alpha], "seconds": round(time.time() - started),
            "switches": {k: v for k, v in os.environ.items() if k.startswith("EXP_")},
            "train_flags": args.train_flags, **({"scoring": "held out"} if args.held_out else {})}
    print(json.dumps(line))
    with open(f"{args.workdir}/results.jsonl", "a") as results:
        results.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
