"""P2 and P5 (not a test): store size of bf16 / bf16+zstd / fp8 / fp8+zstd / int8+zstd on REAL demo-model
states, the τ that fp8 and int8 cost, and τ of Beagle ÷ τ of EAGLE-2 trained on the same store for the same steps.

One run: the bf16 store written by `extract` (from bench/extract.py or --store) is split into a training
part and the last `--eval-samples` samples, held out. The training part is re-written sample for sample
as bf16, bf16 + zstd, fp8 (e4m3, per-token scale), fp8 + zstd and int8 + zstd; bytes on disk per token ÷
raw bf16 bytes (layers × d × 2) excluding the per-store head. Then drafters train through the real CLI:
Beagle on bf16 and EAGLE-2 on bf16 for each of `--steps` (P5 asks for 300 and 1000), and Beagle on fp8 and
on int8 + zstd for the first (P2's τ cost); all are scored by the same offline chain acceptance (bench/acceptance.py) on the held-out
samples, with per-depth acceptance.

    python bench/quality.py --store STORE [--quick] [--steps 300,1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.acceptance import score_drafter  # noqa: E402
from beagle.registry import form_for  # noqa: E402
from bench.common import cli, emit, record  # noqa: E402
from beagle.data import StoreSet  # noqa: E402
from beagle.torch_store import open_store  # noqa: E402
from pipeline.extract.state_encoding import write_store  # noqa: E402


def _bytes(url: str) -> int:
    total = 0
    for root, _, files in os.walk(url):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f != "head.safetensors")
    return total


def rewrite(src: str, dst: str, dtype: str, compression: str | None, indices: range | None = None) -> float:
    """Copy samples `indices` (all by default) of `src` into `dst` in `dtype`/`compression`; return stored
    bytes ÷ raw bf16 bytes."""
    store = open_store(src)
    manifest = store.manifest
    indices = indices if indices is not None else range(len(store))
    samples = ({k: store[i][k] for k in ("sample_id", "input_ids", "loss_mask", "hidden_states")} for i in indices)
    capture = {**manifest.get("capture", {}), "dtype": dtype, **({"compression": compression} if compression else {})}
    write_store(dst, samples, head=store.load_head(), target=store.target, tokenizer=manifest.get("tokenizer", {}),
                capture=capture, source=manifest.get("source", {}), overwrite=True, compression=compression,
                samples_per_shard=max(1, len(indices) // 4))
    raw = int(store.lengths[list(indices)].sum()) * len(store.layers) * store.hidden_size * 2
    return _bytes(dst) / raw


# Both drafters train their token loss over the same reduced vocabulary (about 5x faster on CPU) and
# draft over it, as `eval` does.
DRAFT_VOCAB = 8192


def train(store: str, out: str, drafter: str, steps: int, batch_tokens: int, max_length: int, *extra: str) -> str:
    """Train through the CLI for `steps` (stage 1 only for Beagle), lr 1e-3, the draft vocabulary;
    `extra` flags are appended (bench/layers.py adds --fuse-layers, bench/depth1.py --window-size)."""
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time: `train` refuses to reuse a run folder
    simulates = form_for(drafter, "embedding").simulates  # a teacher-forced form has no stage 2 of its own
    cli("train", "--store", store, "--out", out, "--drafter", drafter, "--max-steps", str(steps),
        "--stage1-epochs", "1000", "--stage2-epochs", "1000" if simulates else "0",
        "--batch-tokens", str(batch_tokens), "--max-length", str(max_length), "--lr", "1e-3",
        "--warmup-steps", "10", "--draft-vocab", str(DRAFT_VOCAB), "--device", "cpu", "--no-progress", *extra)
    return f"{out}/drafter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, help="bf16 store written by extract from the demo model")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", default=None,
                        help="training steps, comma-separated: one P5 figure each [300,1000; --quick: 30]")
    parser.add_argument("--eval-samples", type=int, default=None)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    steps_list = [int(s) for s in (args.steps or ("30" if args.quick else "300,1000")).split(",")]
    eval_samples = args.eval_samples or (6 if args.quick else 32)
    batch_tokens, max_length = (512, 256) if args.quick else (2048, 512)
    work = args.workdir or tempfile.mkdtemp(prefix="bench-quality-")
    total = len(open_store(args.store))
    if total <= 2 * eval_samples:
        raise SystemExit(f"{args.store} has {total} samples: too few to hold out {eval_samples} (--eval-samples)")
    training, held_out = range(total - eval_samples), range(total - eval_samples, total)
    ratios = {name: rewrite(args.store, f"{work}/{name}", dtype, comp, training) for name, dtype, comp in
              (("bf16", "bfloat16", None), ("bf16-zstd", "bfloat16", "zstd"), ("fp8", "float8_e4m3", None),
               ("fp8-zstd", "float8_e4m3", "zstd"), ("int8-zstd", "int8", "zstd"))}
    rewrite(args.store, f"{work}/held-out", "bfloat16", None, held_out)
    tokens = int(open_store(f"{work}/bf16").lengths.sum())
    size = {"tokens": tokens, "model": "SmolLM2-135M-Instruct (demo), layer -1"}
    records = [
        record("P2", "store bytes ÷ raw, bf16", ratios["bf16"], 1.01, "<=", f"{ratios['bf16']:.4f}", size,
               why="the per-sample Arrow table (ids, mask) and Zarr metadata are a larger share of a tiny store"),
        record("P2", "store bytes ÷ raw, bf16 + zstd", ratios["bf16-zstd"], 0.90, "<=", f"{ratios['bf16-zstd']:.4f}",
               size, why="bf16 hidden states are high-entropy (mantissas look random): lossless zstd finds little"),
        record("P2", "store bytes ÷ raw, fp8 e4m3", ratios["fp8"], 0.52, "<=", f"{ratios['fp8']:.4f}", size,
               why="the per-token float32 scale (4 bytes) and the sample table add to 1 byte per value"),
        record("P2", "store bytes ÷ raw, fp8 e4m3 + zstd", ratios["fp8-zstd"], 0.35, "<=", f"{ratios['fp8-zstd']:.4f}",
               size, why="e4m3 codes of real states carry ~6.8 bits of entropy: no lossless coder gets them under "
                         "~0.42 of bf16 (docs/benchmarks.md, smaller stores); int8 codes carry ~4.8"),
        record("P2", "store bytes ÷ raw, int8 + zstd", ratios["int8-zstd"], 0.35, "<=",
               f"{ratios['int8-zstd']:.4f}", size, why="the codes' entropy (~4.8 bits) and the per-token scale"),
    ]

    def settings(steps: int) -> dict:
        return {"steps": steps, "batch_tokens": batch_tokens, "max_length": max_length, "lr": 1e-3,
                "draft_vocab": DRAFT_VOCAB, "train_tokens": tokens,
                "eval": f"offline chain depth 5 on {eval_samples} held-out samples"}

    # The first steps' runs keep their plain names: bench/run_all.py's P6 decodes with run-beagle-bf16.
    def run_name(drafter: str, steps: int) -> str:
        return drafter if steps == steps_list[0] else f"{drafter}-{steps}"

    runs = {run_name("beagle-fp8", steps_list[0]): ("fp8", "beagle", steps_list[0]),
            run_name("beagle-int8", steps_list[0]): ("int8-zstd", "beagle", steps_list[0])}
    for steps in steps_list:
        runs[run_name("beagle-bf16", steps)] = ("bf16", "beagle", steps)
        runs[run_name("eagle2-bf16", steps)] = ("bf16", "eagle2", steps)
    head = StoreSet([f"{work}/held-out"]).load_head()
    scores = {}
    for name, (store, drafter, steps) in runs.items():
        path = train(f"{work}/{store}", f"{work}/run-{name}", drafter, steps, batch_tokens, max_length)
        scores[name] = score_drafter(path, f"{work}/held-out", head, samples=eval_samples, limit=max_length)
        print(f"{name}: tau {scores[name][0]:.3f} alpha {[round(a, 3) for a in scores[name][1]]}")
    tb, tf = scores["beagle-bf16"][0], scores["beagle-fp8"][0]
    records.append(record("P2", "τ fp8 ÷ τ bf16 (Beagle)", tf / tb, 0.97, ">=", f"τ {tf:.3f} vs {tb:.3f}",
                          settings(steps_list[0]), why="a few training steps leave τ near 1 and noisy; see settings"))
    ti = scores["beagle-int8"][0]
    records.append(record("P2", "τ int8 + zstd ÷ τ bf16 (Beagle)", ti / tb, 0.97, ">=", f"τ {ti:.3f} vs {tb:.3f}",
                          settings(steps_list[0]), why="int8's rounding error (per-token cosine 0.9994) shows in τ"))
    for steps in steps_list:
        (tb, ab), (te, ae) = scores[run_name("beagle-bf16", steps)], scores[run_name("eagle2-bf16", steps)]
        records.append(record(
            "P5", f"τ Beagle ÷ τ EAGLE-2, {steps} steps", tb / te, 1.0, ">=",
            f"τ {tb:.3f} vs {te:.3f}; α Beagle {[round(a, 2) for a in ab]}, EAGLE-2 {[round(a, 2) for a in ae]}",
            settings(steps), why="EAGLE-2's queries carry the previous state; Beagle's depth 1 trails at equal "
                                 "steps (docs/training.md, the depth-1 gap)"))
    Path(f"{work}/scores.json").write_text(json.dumps(scores, indent=2))
    emit(records, args.json)


if __name__ == "__main__":
    main()
