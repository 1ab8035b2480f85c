"""P17 (not a test): `extract` tokens/s with `--engine vllm` ÷ with `--engine hf`, same conversations, same machine.

Each engine runs the real job (`run_extract`: a local Ray, streamed tokenize tasks, one forward actor, the store
writer) on the demo target over the same ShareGPT conversations, into a fresh store, in a fresh child process,
one after the other (hf first). The forward actor of `--engine vllm` runs vLLM's CPU build (.venv-vllm) in a
worker process with its `extract_hidden_states` method (pipeline/extract/vllm_forward.py).
Reported for each: the forward stage's tokens/s (first shard handed out to the last committed, the actor's start
included: what a user waits for), the actor's forward-only tokens/s (the engine's pace once started), the actor's
start, and the peak memory of the child's process tree (the sum of RSS over its processes, sampled every 0.5 s:
Ray's, the actor's, vLLM's; pages shared between processes are counted in each, so an upper bound).
P17 = stage tokens/s, vLLM ÷ hf (target ≥ 1.0); the forward-only ratio is printed beside it. The two stores'
states are also compared (bf16: two engines' kernels round differently; the fp32 equality is a test,
tests/test_extract_vllm.py).

    python bench/extract_engines.py [--quick] [--limit 256] [--max-length 1024] [--layers -2,-1] [--json p17.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO_MODEL, DEMO_SHAREGPT, emit, record, require_demo, run_measured  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def engine_child(args: argparse.Namespace) -> None:
    """One extraction with `args.child`'s engine into `args.out`; prints its figures as one JSON line."""
    from pipeline.extract.pipeline import ExtractConfig, run_extract

    layers = tuple(int(x) for x in args.layers.split(","))
    config = ExtractConfig(model_path=str(DEMO_MODEL), data=(str(DEMO_SHAREGPT),), out=args.out, layers=layers,
                           dtype=args.dtype, max_length=args.max_length, limit=args.limit, num_workers=1,
                           samples_per_shard=max(1, args.limit // 8), engine=args.child, overwrite=True)
    started = time.perf_counter()
    summary = run_extract(config)
    print(json.dumps({"engine": args.child, "seconds": time.perf_counter() - started,
                      "samples": summary.samples, "tokens": summary.forward_tokens,
                      "stage_seconds": summary.forward_seconds, "forward_seconds": summary.actor_forward_seconds,
                      "busy_seconds": summary.actor_busy_seconds, "stage_tokens_per_second": summary.tokens_per_second}))


def measure_engine(engine: str, args: argparse.Namespace, out: str) -> dict:
    """`engine_child` in a fresh interpreter, its process tree's memory sampled meanwhile."""
    command = [sys.executable, __file__, "--child", engine, "--out", out, "--limit", str(args.limit),
               "--max-length", str(args.max_length), f"--layers={args.layers}", "--dtype", args.dtype]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)}
    out_text, _, peak = run_measured(command, env, f"{engine} child")
    return {**json.loads(out_text.strip().splitlines()[-1]), "peak_rss_mib": peak}


def compare_states(hf_store: str, vllm_store: str) -> dict:
    """The largest relative difference of the two stores' states, per layer, and whether tokens agree."""
    import numpy as np

    from pipeline.store import open_store

    a, b = open_store(hf_store), open_store(vllm_store)
    worst = [0.0] * len(a.layers)
    same_tokens = len(a) == len(b)
    for index in range(min(len(a), len(b))):
        x, y = a.get_numpy(index), b.get_numpy(index)
        same_tokens &= bool((x["input_ids"] == y["input_ids"]).all() and (x["loss_mask"] == y["loss_mask"]).all())
        for layer, (p, q) in enumerate(zip(x["hidden_states"], y["hidden_states"])):
            p, q = np.asarray(p, np.float32), np.asarray(q, np.float32)  # [L, d]
            worst[layer] = max(worst[layer], float(np.abs(p - q).max() / max(np.abs(p).max(), 1e-9)))
    return {"same_tokens_and_masks": same_tokens, "worst_relative_by_layer": dict(zip(map(str, a.layers), worst))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 conversations of <= 256 tokens")
    parser.add_argument("--limit", type=int, default=None, help="conversations (default 256; --quick 32)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens each (default 1024; --quick 256)")
    parser.add_argument("--layers", default="-2,-1", help="captured layers (default: the demo's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, choices=["hf", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_demo()
    args.limit = args.limit or (32 if args.quick else 256)
    args.max_length = args.max_length or (256 if args.quick else 1024)
    if args.child:
        engine_child(args)
        return
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-extract-engines-")
    runs = {}
    for engine in ("hf", "vllm"):
        runs[engine] = r = measure_engine(engine, args, f"{workdir}/{engine}")
        print(f"{engine}: {r['tokens']:,} tokens; stage {r['stage_seconds']:.1f}s = {r['stage_tokens_per_second']:,.0f} "
              f"tokens/s; forward only {r['forward_seconds']:.1f}s = {r['tokens'] / r['forward_seconds']:,.0f} tokens/s; "
              f"peak memory {r['peak_rss_mib']:,.0f} MiB", flush=True)
    states = compare_states(f"{workdir}/hf", f"{workdir}/vllm")
    print(f"states: {states}")
    hf, vllm = runs["hf"], runs["vllm"]
    forward_ratio = (vllm["tokens"] / vllm["forward_seconds"]) / (hf["tokens"] / hf["forward_seconds"])
    settings = {"conversations": args.limit, "max_length": args.max_length, "layers": args.layers,
                "dtype": args.dtype, "runs": runs, "forward_only_ratio": forward_ratio,
                "memory_ratio": vllm["peak_rss_mib"] / hf["peak_rss_mib"], "states": states}
    ratio = vllm["stage_tokens_per_second"] / hf["stage_tokens_per_second"]
    emit([record("P17", "extract tokens/s, vLLM ÷ hf", ratio, 1.0, ">=",
                 f"{vllm['stage_tokens_per_second']:,.0f} vs {hf['stage_tokens_per_second']:,.0f} tokens/s over the "
                 f"forward stage ({forward_ratio:.2f}x forward only); peak RSS {vllm['peak_rss_mib']:,.0f} vs "
                 f"{hf['peak_rss_mib']:,.0f} MiB", settings,
                 why="vLLM's start (its engine and the driver's probe) and its CPU build's prefill on 2 cores")],
         args.json)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
