"""Benchmark the feature store (not a test): size overhead, write speed, read path vs memcpy.

Prints, measured in one run, for each hidden width:
  bytes on disk per token / raw (layers * d * 2 bytes for bf16)
  write MB/s (hidden-state bytes / wall time of write_store)
  training read path bytes/s / numpy memcpy bytes/s of the same bytes (page-cached local data)

The read path is what the trainer does: `store[i]` for every sample in a shuffled order, touching every
byte of the returned hidden states (a sum), so that a lazy view cannot look free.

    python bench/store.py [--tokens 400000] [--widths 576,4096]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from beagle.store_tensors import open_store
from pipeline.extract.store_tensors import write_store


def synthetic_samples(num_tokens: int, width: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    total = 0
    while total < num_tokens:
        length = int(torch.randint(128, 2048, (1,), generator=generator))
        lengths.append(length)
        total += length
    for index, length in enumerate(lengths):
        yield {"sample_id": f"s{index}", "input_ids": torch.randint(0, 49152, (length,), generator=generator),
               "loss_mask": torch.ones(length, dtype=torch.bool),
               "hidden_states": (torch.randn(1, length, width, generator=generator) * 2).bfloat16()}


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)


def memcpy_bytes_per_second(nbytes: int, repeats: int = 5) -> float:
    source = np.random.default_rng(0).integers(0, 65535, nbytes // 2, dtype=np.uint16)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def read_path_bytes_per_second(url: str, repeats: int = 3) -> tuple[float, int]:
    store = open_store(url)
    order = np.random.default_rng(0).permutation(len(store))
    best, nbytes = float("inf"), 0
    for _ in range(repeats):
        nbytes = 0
        start = time.perf_counter()
        for index in order:
            hidden = store[int(index)]["hidden_states"]  # [1, L, d] bf16
            # What a trainer does first with a batch: materialise it as a contiguous tensor.
            batch = hidden.clone()
            nbytes += batch.numel() * 2
        best = min(best, time.perf_counter() - start)
    return nbytes / best, nbytes


def run(width: int, num_tokens: int, workdir: str) -> dict:
    url = os.path.join(workdir, f"store-{width}")
    samples = list(synthetic_samples(num_tokens, width))
    tokens = sum(len(s["input_ids"]) for s in samples)
    head = {"embed_tokens": torch.zeros(8, width), "lm_head": torch.zeros(8, width)}
    start = time.perf_counter()
    write_store(url, samples, head=head, target={"name": "synthetic", "architecture": {"hidden_size": width}},
                tokenizer={}, capture={"layers": [-1], "dtype": "bfloat16", "max_length": 2048}, source={},
                samples_per_shard=64, overwrite=True)
    write_seconds = time.perf_counter() - start
    raw = tokens * width * 2
    head_bytes = os.path.getsize(os.path.join(url, "head.safetensors"))
    stored = directory_bytes(url) - head_bytes  # the head is per store, not per token
    read_rate, read_bytes = read_path_bytes_per_second(url)
    copy_rate = memcpy_bytes_per_second(read_bytes)
    shutil.rmtree(url)
    return {"width": width, "tokens": tokens, "bytes_ratio": stored / raw, "write_mb_s": raw / write_seconds / 1e6,
            "read_gb_s": read_rate / 1e9, "memcpy_gb_s": copy_rate / 1e9, "read_ratio": read_rate / copy_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200_000, help="tokens per store (default 200k)")
    parser.add_argument("--widths", default="576,4096", help="comma-separated hidden sizes")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-store-")
    print(f"{'d':>6} {'tokens':>9} {'bytes/raw':>10} {'write MB/s':>11} {'read GB/s':>10} "
          f"{'memcpy GB/s':>12} {'read/memcpy':>12}")
    for width in (int(w) for w in args.widths.split(",")):
        tokens = args.tokens if width <= 1024 else max(20_000, args.tokens // 8)
        r = run(width, tokens, workdir)
        print(f"{r['width']:>6} {r['tokens']:>9} {r['bytes_ratio']:>10.4f} {r['write_mb_s']:>11.1f} "
              f"{r['read_gb_s']:>10.2f} {r['memcpy_gb_s']:>12.2f} {r['read_ratio']:>12.2f}")


if __name__ == "__main__":
    main()
