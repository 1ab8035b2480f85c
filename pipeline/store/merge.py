"""Merging stores made with the same target, tokenizer and capture settings into one.

Teams extract different datasets (or the same one on different clusters) and share the results; a merge
deduplicates by sample id (first store wins), rewrites shards, and recomputes counts and checksums, so
the result is an ordinary store that `verify` checks like any other.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pipeline.store import files
from pipeline.store import format as fmt
from pipeline.store.errors import StoreConflictError
from pipeline.store.reader import FeatureStore, open_store
from pipeline.store.writer import (begin_store, commit_manifest, committed_shards, store_identity, store_lock,
                                   write_head_bytes, write_rejects, write_shard)

log = logging.getLogger(__name__)

# What must agree for two stores' samples to be interchangeable.
COMPATIBILITY_KEYS = ("target", "tokenizer", "capture")


def first_difference(left: Any, right: Any, path: str) -> str | None:
    """The dotted path of the first field where two JSON values differ, or None if equal."""
    if isinstance(left, dict) and isinstance(right, dict):
        for key in sorted(set(left) | set(right)):
            found = first_difference(left.get(key), right.get(key), f"{path}.{key}")
            if found:
                return found
        return None
    return None if left == right else path


def check_compatible(stores: list[FeatureStore]) -> None:
    """Raise StoreConflictError naming the first differing field between the first store and another."""
    reference = stores[0]
    for other in stores[1:]:
        for key in COMPATIBILITY_KEYS:
            field = first_difference(reference.manifest.get(key), other.manifest.get(key), key)
            if field:
                raise StoreConflictError(
                    f"cannot merge {other.url} into {reference.url}: {field} differs "
                    f"({_lookup(reference.manifest, field)!r} vs {_lookup(other.manifest, field)!r}); "
                    "only stores made with the same target, tokenizer and capture settings can be merged")


def _lookup(manifest: dict, dotted: str) -> Any:
    value: Any = manifest
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def merge_stores(urls: list[str], out: str, *, overwrite: bool = False, samples_per_shard: int = 1024,
                 progress: Callable[[int], None] | None = None) -> dict:
    """Merge `urls` into a new store at `out`; returns its manifest. Resumable like extraction."""
    if len(urls) < 2:
        raise ValueError("merge needs at least two stores")
    # Inputs are verified as they are read (each file's checksum before its first use): a merge rehashes
    # everything it writes, so a damaged input read without checking would come out as a store that verifies.
    stores = [open_store(url, verify="first-read") for url in urls]
    check_compatible(stores)
    reference = stores[0].manifest
    source = {"merged_from": [{"dataset_id": s.dataset_id, "source": s.manifest["source"]} for s in stores]}
    identity = store_identity(target=reference["target"], tokenizer=reference["tokenizer"],
                              capture=reference["capture"], source=source)
    dataset_id = fmt.compute_dataset_id(identity)
    with store_lock(out):
        if begin_store(out, dataset_id, overwrite=overwrite, command="merge") == "complete":
            log.info("%s is already the complete merge of these stores", out)
            return open_store(out).manifest
        done = committed_shards(out, remove_damaged=True)
        shards: list[dict] = []
        duplicates = 0
        batch: list[dict] = []
        for sample, is_duplicate in _unique_samples(stores, progress):
            duplicates += is_duplicate
            if is_duplicate:
                continue
            batch.append(sample)
            if len(batch) == samples_per_shard:
                shards.append(_write_or_reuse(out, len(shards), batch, reference, done))
                batch = []
        if batch:
            shards.append(_write_or_reuse(out, len(shards), batch, reference, done))
        write_head_bytes(out, stores[0].head_bytes())  # checked against its checksum; written atomically
        rejects, rejected = _gather_rejects(stores)
        if rejects:
            write_rejects(out, rejects)
        return commit_manifest(out, dataset_id=dataset_id, target=reference["target"],
                               tokenizer=reference["tokenizer"], capture=reference["capture"], source=source,
                               shards=shards, rejected=rejected,
                               extra={"merge": {"inputs": [s.url for s in stores], "duplicates_dropped": duplicates}})


def _unique_samples(stores: list[FeatureStore], progress: Callable[[int], None] | None) -> Iterator[tuple[dict, bool]]:
    seen: set[str] = set()
    for store in stores:
        for index in range(len(store)):
            sample = store.get_numpy(index, decode=False)  # fp8 codes are copied, never re-encoded
            duplicate = sample["sample_id"] in seen
            seen.add(sample["sample_id"])
            if progress:
                progress(1)
            yield sample, duplicate


def _write_or_reuse(out: str, index: int, batch: list[dict], reference: dict, done: dict[int, dict]) -> dict:
    if index in done:
        return done[index]
    samples = []
    for s in batch:
        sample = {"sample_id": s["sample_id"], "input_ids": s["input_ids"], "loss_mask": s["loss_mask"],
                  "hidden_states": np.stack([np.asarray(layer) for layer in s["hidden_states"]])}  # [n, L, d]
        if "hidden_scales" in s:
            sample["hidden_scales"] = np.stack([np.asarray(layer) for layer in s["hidden_scales"]])  # [n, L]
        samples.append(sample)
    return write_shard(out, index, samples, layers=reference["capture"]["layers"], dtype=reference["dtype"],
                       compression=reference["capture"].get("compression"))  # the inputs' codec, as recorded


def _gather_rejects(stores: list[FeatureStore]) -> tuple[list[dict], Counter]:
    rejects: list[dict] = []
    for store in stores:
        if fmt.REJECTS not in store.manifest["files"]:
            continue
        payload = files.read_bounded(store.fs, store.root, fmt.REJECTS, store.manifest["files"][fmt.REJECTS]["bytes"])
        rejects.extend(json.loads(line) for line in payload.decode("utf-8").splitlines() if line)
    return rejects, Counter(str(r.get("reason", "unknown")) for r in rejects)
