"""P1 and P7 (not a test): extraction throughput against a bare forward, and 2 Ray workers against 1.

P1 = tokens/s of `extract` (streamed tokenize tasks, forward actors with hidden states, store writes; forward stage
wall time) ÷ tokens/s of a bare `model.model` forward over the same samples one at a time, same dtype,
same process, same threads. P7 = forward-stage tokens/s with 2 CPU workers ÷ 1 worker, one torch thread
per worker on both sides (ExtractConfig.threads), so the ratio measures scale-out and not threading.

    python bench/extract.py [--quick] [--limit 48] [--max-length 512] [--json out.json] [--skip-p7]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import DEMO_MODEL, DEMO_SHAREGPT, emit, record, require_demo  # noqa: E402
from bench.cpu_accounting import cpu_accounting  # noqa: E402
from pipeline.extract.pipeline import ExtractConfig, run_extract  # noqa: E402
from pipeline.extract.summary import ExtractSummary  # noqa: E402
from pipeline.store import open_store  # noqa: E402


def extract(out: str, limit: int, max_length: int, workers: int, threads: int | None = None) -> ExtractSummary:
    shutil.rmtree(out, ignore_errors=True)  # measure a whole extraction, never the no-op of a complete store
    config = ExtractConfig(model_path=str(DEMO_MODEL), data=(str(DEMO_SHAREGPT),), out=out, max_length=max_length,
                           limit=limit, num_workers=workers, samples_per_shard=max(1, limit // 4),
                           threads=threads)
    return run_extract(config)


def stage_profile(summary: ExtractSummary) -> dict[str, float]:
    """Where the forward stage's wall time went (one actor): its start (process, model load) before the
    first forward, the forwards, and the rest of its busy time (waiting for shards, writes not hidden)."""
    busy = summary.actor_busy_seconds
    return {"stage_s": round(summary.forward_seconds, 1), "actor_start_s": round(summary.forward_seconds - busy, 1),
            "forward_s": round(summary.actor_forward_seconds, 1),
            "busy_not_forward_s": round(busy - summary.actor_forward_seconds, 1),
            "writes_hidden_s": round(summary.write_overlap_seconds, 1)}


def bare_forward(store_url: str, threads: int) -> float:
    """tokens/s of model.model (no LM head, as extraction) over the store's samples, one at a time."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.bfloat16).eval()
    store = open_store(store_url)
    samples = [torch.as_tensor(store[i]["input_ids"]) for i in range(len(store))]  # the store gives numpy
    with torch.inference_mode():
        model.model(input_ids=samples[0][None])                       # warm-up
        start = time.perf_counter()
        for ids in samples:
            model.model(input_ids=ids[None])
        seconds = time.perf_counter() - start
    return sum(len(s) for s in samples) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 conversations of <= 256 tokens")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--skip-p7", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_demo()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # 256 ShareGPT conversations of <= 1024 tokens (~110k tokens): minutes of forward, so that the actor's
    # start (seconds) and the first and last shards, which cannot overlap a write, weigh a few percent.
    limit = args.limit or (16 if args.quick else 256)
    max_length = args.max_length or (256 if args.quick else 1024)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-extract-")
    cores = os.cpu_count() or 1
    with cpu_accounting() as extraction_cpu:
        summary = extract(f"{workdir}/p1", limit, max_length, workers=1)
    ext_rate, tokens = summary.tokens_per_second, summary.forward_tokens
    with cpu_accounting() as bare_cpu:
        bare_rate = bare_forward(f"{workdir}/p1", threads=cores)
    profile = stage_profile(summary)
    cpu = extraction_cpu.summary()
    settings = {"conversations": limit, "max_length": max_length, "tokens": tokens, "dtype": "bfloat16",
                "threads": cores, **profile, "extract_cpu_s": cpu, "bare_cpu_s": bare_cpu.summary()}
    print(f"CPU seconds during extract ({extraction_cpu.wall_seconds:.0f}s wall x {cores} cores): {cpu}; "
          f"bare forward ({bare_cpu.wall_seconds:.0f}s): {bare_cpu.summary()}")
    in_actor = tokens / max(profile["forward_s"], 1e-9)
    records = [record("P1", "extraction ÷ bare forward tokens/s", ext_rate / bare_rate, 0.95, ">=",
                      f"{ext_rate:,.0f} vs {bare_rate:,.0f} tokens/s", settings,
                      why=f"inside the actor the forwards ran at {in_actor:,.0f} tokens/s ({in_actor / bare_rate:.2f} "
                          f"of bare) and its start took {profile['actor_start_s']}s of the {profile['stage_s']}s "
                          f"stage; over the job, Ray's workers (the actor, tokenize tasks) used "
                          f"{cpu.get('Ray workers', 0) + cpu.get('actor', 0):.0f} CPU-s where the bare forward used "
                          f"{bare_cpu.seconds['driver']:.0f}, the driver {cpu.get('driver', 0):.0f}, Ray's services "
                          f"{cpu.get('Ray services', 0):.0f}, and {cpu['idle']:.0f} of {cpu['capacity']:.0f} core-s "
                          f"stayed idle (bare: {bare_cpu.idle_seconds:.0f}): the actor's forward threads do not keep "
                          f"both cores busy beside Ray's start, its threads and the driver")]
    if not args.skip_p7:
        one = extract(f"{workdir}/p7-1", limit, max_length, workers=1, threads=1)
        with cpu_accounting() as two_cpu:
            two = extract(f"{workdir}/p7-2", limit, max_length, workers=2, threads=1)
        rate1, rate2 = one.tokens_per_second, two.tokens_per_second
        cpu2 = two_cpu.summary()
        forward1, forward2 = one.forward_tokens / one.actor_forward_seconds, \
            two.forward_tokens / (two.actor_forward_seconds / max(two.actors, 1))
        records.append(record("P7", "2 Ray workers ÷ 1 worker, one thread each", rate2 / rate1, 1.8, ">=",
                              f"{rate2:,.0f} vs {rate1:,.0f} tokens/s",
                              {**settings, "threads_per_worker": 1, "two_workers_cpu_s": cpu2},
                              why=f"the two actors' forwards ran at {forward2:,.0f} tokens/s together against "
                                  f"{forward1:,.0f} for one ({forward2 / forward1:.2f}x): they share {cores} cores "
                                  f"with the driver ({cpu2.get('driver', 0):.0f} CPU-s), Ray's services "
                                  f"({cpu2.get('Ray services', 0):.0f}) and each other's writes; "
                                  f"{cpu2['idle']:.0f} of {cpu2['capacity']:.0f} core-s stayed idle (the actors' "
                                  "starts, the first and last shards)"))
    emit(records, args.json)


if __name__ == "__main__":
    main()
