"""Benchmark the feature store (not a test): size overhead, write speed, read path vs memcpy.

Prints, measured in one run, for each hidden width:
  bytes on disk per token / raw (layers * d * 2 bytes for bf16)
  write MB/s (hidden-state bytes / wall time of write_store)
  training read path bytes/s / numpy memcpy bytes/s of the same bytes (page-cached local data)

P8 (--p8): one shard's `write_shard` bytes/s ÷ a raw fsync'd write of the same hidden-state bytes to the same
filesystem, best of 3 each, alternated, on --workdir's disk and on /dev/shm (tmpfs), at each width. The shard
keeps every guarantee (atomic commit, a checksum of every file (BLAKE3), fsync), the raw write none.

The read path is what the trainer does: `store[i]` for every sample in a shuffled order, touching every
byte of the returned hidden states (a sum), so that a lazy view cannot look free.

    python bench/store.py [--tokens 400000] [--widths 576,4096]
    python bench/store.py --p8 [--shard-tokens 65536] [--json p8.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any, Sequence

import numpy as np
import torch

from beagle.torch_store import open_store
from pipeline.extract.state_encoding import write_store


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


def filesystem_type(path: str) -> str:
    """The type of the filesystem `path` lives on (longest mount point that prefixes it), e.g. ext4, tmpfs."""
    best, kind = "", "?"
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            _, point, fstype = line.split()[:3]
            if os.path.realpath(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fstype
    return kind


def shard_samples(num_tokens: int, width: int, seed: int = 0) -> list[dict]:
    """Samples in storage form (bf16 as uint16 bits, numpy), ~`num_tokens` tokens: what `write_shard` takes."""
    rng = np.random.default_rng(seed)
    samples, total = [], 0
    while total < num_tokens:
        length = int(rng.integers(128, 2048))
        samples.append({"sample_id": f"s{len(samples)}", "input_ids": rng.integers(0, 49152, length),
                        "loss_mask": np.ones(length, dtype=np.uint8),
                        "hidden_states": rng.integers(0, 1 << 16, (1, length, width), dtype=np.uint16)})
        total += length
    return samples


def raw_write_seconds(path: str, buffers: Sequence[Any]) -> float:
    """Seconds to write `buffers` to a new file at `path` and fsync it (the file is removed after): what the
    filesystem allows, against which a writer's rate is read."""
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for buffer in buffers:
            handle.write(buffer)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def hash_seconds(buffers: Sequence[Any]) -> float:
    """Seconds one core takes to hash `buffers` as one stream with the store's checksum (BLAKE3): the floor
    of a writer that hashes every file it writes, one stream per file."""
    from pipeline.store.hashing import new_digest

    start = time.perf_counter()
    digest = new_digest()
    for buffer in buffers:
        digest.update(memoryview(buffer).cast("B"))
    return time.perf_counter() - start


def p8(width: int, num_tokens: int, directory: str, repeats: int = 3) -> dict:
    from pipeline.store.hashing import DEFAULT_CHECKSUM
    """write_shard ÷ raw fsync'd write of the same bytes, on `directory`'s filesystem."""
    from pipeline.store.writer import write_shard

    samples = shard_samples(num_tokens, width)
    nbytes = sum(s["hidden_states"].nbytes for s in samples)
    os.makedirs(directory, exist_ok=True)
    raw_best = shard_best = hash_best = float("inf")
    for attempt in range(repeats):
        hash_best = min(hash_best, hash_seconds([s["hidden_states"] for s in samples]))
        raw_best = min(raw_best, raw_write_seconds(os.path.join(directory, f"raw-{attempt}.bin"),
                                                   [memoryview(s["hidden_states"]).cast("B") for s in samples]))
        url = os.path.join(directory, f"store-{attempt}")
        os.makedirs(os.path.join(url, "shards"), exist_ok=True)
        start = time.perf_counter()
        write_shard(url, 0, samples, layers=[-1], dtype="bfloat16")
        shard_best = min(shard_best, time.perf_counter() - start)
        shutil.rmtree(url)
    return {"width": width, "tokens": sum(len(s["input_ids"]) for s in samples), "gb": nbytes / 1e9,
            "filesystem": filesystem_type(directory), "raw_gb_s": nbytes / raw_best / 1e9,
            "shard_gb_s": nbytes / shard_best / 1e9, "ratio": raw_best / shard_best,
            "hash": DEFAULT_CHECKSUM, "hash_gb_s": nbytes / hash_best / 1e9, "hash_ceiling": raw_best / hash_best}


def main_p8(args: argparse.Namespace, workdir: str) -> None:
    import json

    from pipeline.store.hashing import DEFAULT_CHECKSUM

    directories = [workdir] + (["/dev/shm/bench-store-p8"] if os.path.isdir("/dev/shm") else [])
    print("ratio: write_shard ÷ raw fsync'd write; hash ceiling: the ratio a writer reaches if hashing the "
          f"bytes once ({DEFAULT_CHECKSUM}), on one core, were all it did (raw time ÷ hash time)")
    print(f"{'filesystem':>10} {'d':>6} {'tokens':>8} {'GB':>6} {'raw GB/s':>9} {'shard GB/s':>11} {'ratio':>6} "
          f"{'hash GB/s':>12} {'hash ceiling':>13}")
    results = []
    for directory in directories:
        for width in (int(w) for w in args.widths.split(",")):
            r = p8(width, args.shard_tokens if width > 1024 else args.shard_tokens * 4, directory)
            results.append(r)
            print(f"{r['filesystem']:>10} {r['width']:>6} {r['tokens']:>8} {r['gb']:>6.2f} {r['raw_gb_s']:>9.2f} "
                  f"{r['shard_gb_s']:>11.2f} {r['ratio']:>6.2f} {r['hash_gb_s']:>12.2f} {r['hash_ceiling']:>13.2f}",
                  flush=True)
        if directory.startswith("/dev/shm"):
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200_000, help="tokens per store (default 200k)")
    parser.add_argument("--widths", default="576,4096", help="comma-separated hidden sizes")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--p8", action="store_true", help="measure P8 (shard write ÷ raw write) instead")
    parser.add_argument("--shard-tokens", type=int, default=65_536,
                        help="P8: tokens of the d=4096 shard (4x that at smaller widths)")
    parser.add_argument("--json", default=None, help="P8: write the figures here")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-store-")
    if args.p8:
        main_p8(args, workdir)
        return
    print(f"{'d':>6} {'tokens':>9} {'bytes/raw':>10} {'write MB/s':>11} {'read GB/s':>10} "
          f"{'memcpy GB/s':>12} {'read/memcpy':>12}")
    for width in (int(w) for w in args.widths.split(",")):
        tokens = args.tokens if width <= 1024 else max(20_000, args.tokens // 8)
        r = run(width, tokens, workdir)
        print(f"{r['width']:>6} {r['tokens']:>9} {r['bytes_ratio']:>10.4f} {r['write_mb_s']:>11.1f} "
              f"{r['read_gb_s']:>10.2f} {r['memcpy_gb_s']:>12.2f} {r['read_ratio']:>12.2f}")


if __name__ == "__main__":
    main()
