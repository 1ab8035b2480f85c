"""Writing a feature store: whole shards are the unit of writing, the manifest is written last.

A shard is built under a temporary name, fsynced, then renamed into place (on object stores, where
rename is not atomic, its `shard.json` is written last and is the commit marker). A directory without a
complete `manifest.json` is never read as a store, so a crash can never leave output that looks done.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.store import atomic
from pipeline.store import files
from pipeline.store import format as fmt
from pipeline.store import ownership
from pipeline.store.errors import StoreConflictError, StoreError, StoreFormatError
from pipeline.store.file_lock import exclusive_lock
from pipeline.store.hashing import DEFAULT_CHECKSUM, checksum_entry, entry_checksum
from pipeline.store.object_lock import object_store_lock
from pipeline.store.zarr_io import (plan_raw_hidden_array, write_hidden_array, write_raw_files, write_scale_array,
                                    zarr_store)

log = logging.getLogger(__name__)

SAMPLES_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("length", pa.int32()),
    ("token_offset", pa.int64()),  # first row of this sample in the shard's hidden-state arrays
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
])


def store_identity(*, target: dict, tokenizer: dict, capture: dict, source: dict) -> dict:
    """The facts a dataset_id is computed from; kept verbatim in the manifest so `verify` can recompute it."""
    return {"target": target, "tokenizer": tokenizer, "capture": capture, "source": source}


def begin_store(url: str, dataset_id: str, *, overwrite: bool = False, command: str = "extract") -> str:
    """Claim `url` for building `dataset_id`. Returns "complete", "resume" or "new".

    `command`: what builds the store ("extract", "merge", "write_store"), recorded in the pending marker
    so that a reader of the unfinished store names the command that completes it.

    Refuses (StoreConflictError) a store or half-built store made from other inputs unless `overwrite`,
    in which case that old content is deleted first (a store of this same `dataset_id` is never deleted:
    it is complete, or resumed). Only what is provably a store of ours is ever deleted, and of it only the
    files it lists, its shards' files and this project's temporaries: a `manifest.json` or `_pending.json`
    that is not ours, or any other file in the folder, is refused, naming it, and nothing is deleted.
    Temporary files an interrupted writer left behind are removed. The caller holds `store_lock(url)`.
    """
    fs, root = fmt.open_fs(url)
    try:
        manifest = files.read_json(fs, fmt.join(root, fmt.MANIFEST), files.MANIFEST_MAX_BYTES)
        pending = files.read_json(fs, fmt.join(root, fmt.PENDING)) if manifest is None else None
    except StoreFormatError as error:  # not JSON, not a regular file, far too large: not something we wrote
        raise StoreConflictError(f"{url}: {error}, so not a beagle-pipeline store's; nothing was deleted: move "
                                 "it away, or choose another --out") from None
    existing = manifest if manifest is not None else pending
    if existing is not None:
        ownership.check_ours(url, manifest, pending)
    other_inputs = existing is not None and existing.get("dataset_id") != dataset_id
    if other_inputs and not overwrite:
        raise StoreConflictError(
            f"{url} already holds a store built from other inputs or settings "
            f"(dataset_id {str(existing.get('dataset_id'))[:12]}…, this run {dataset_id[:12]}…); "
            "pass --overwrite to delete it and build this one, or choose another --out")
    if other_inputs:
        owned = ownership.owned_paths(fs, root, manifest)
        foreign = ownership.foreign_files(fs, root, owned)
        if foreign:
            more = f" (and {len(foreign) - 1} other file(s))" if len(foreign) > 1 else ""
            raise StoreConflictError(
                f"{url}: --overwrite deletes only a store's own files, and {foreign[0]}{more} is not one; "
                "nothing was deleted: move it away, or choose another --out")
        log.warning("--overwrite: deleting %s (dataset_id %s) before building %s", url, existing.get("dataset_id"),
                    dataset_id)
        ownership.delete_owned(fs, root, owned)
        existing = None
    if existing is not None:
        _remove_interrupted_writes(fs, root)
    if fs.exists(fmt.join(root, fmt.MANIFEST)):
        if not ownership.reopen_if_damaged(url, fs, root, existing, command):
            return "complete"
        return "resume"
    fs.makedirs(fmt.join(root, fmt.SHARDS_DIR), exist_ok=True)
    if existing is None:
        atomic.write_bytes(fmt.join(root, fmt.PENDING),
                           fmt.canonical_json({"dataset_id": dataset_id, "command": command}), fs=fs)
        return "new"
    return "resume"


def _remove_interrupted_writes(fs: Any, root: str) -> None:
    """Delete what interrupted local writers leave: `NAME.tmp-*` files of atomic writes (a head can be
    GBs), `.shard-*.tmp-*` build folders and `.NAME.old-*` folders of replaced shards. Only under the
    store's lock, when no writer of this store runs; object stores have no such names."""
    if not fmt.is_local(fs):
        return
    for folder in (root, fmt.join(root, fmt.SHARDS_DIR)):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if ".tmp-" not in name and not (name.startswith(".") and ".old-" in name):
                continue
            path = os.path.join(folder, name)
            log.info("removing %s, left by an interrupted writer", path)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def abandon_new_store(url: str) -> None:
    """Undo `begin_store`'s claim of a store that never got a shard (its input turned out empty or all
    rejected), so that the corrected rerun, with other inputs, is not refused as "built from other inputs"."""
    fs, root = fmt.open_fs(url)
    shards_dir = fmt.join(root, fmt.SHARDS_DIR)
    if fs.exists(shards_dir) and fs.ls(shards_dir, detail=False):
        raise StoreError(f"{url}: shards were written; it is an unfinished store, not an abandoned claim")
    if fs.exists(shards_dir):
        fs.rm(shards_dir, recursive=True)
    if fs.exists(fmt.join(root, fmt.PENDING)):
        fs.rm(fmt.join(root, fmt.PENDING))


@contextmanager
def store_lock(url: str) -> Iterator[None]:
    """Hold an exclusive lock on a store while building it, so two jobs never write one store.

    Local stores: a `flock` on STORE/_lock, released by the kernel if the holder dies. Object stores: a
    lock object created by a conditional write, with a lease the holder renews (pipeline/store/object_lock.py).
    """
    fs, root = fmt.open_fs(url)
    if not fmt.is_local(fs):
        with object_store_lock(fs, root, url, StoreConflictError):
            yield
        return
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, fmt.LOCK)
    with exclusive_lock(path, lambda: StoreConflictError(
            f"{url} is being written by another process (it holds {path}); wait for that job to finish, "
            "or choose another --out")):
        yield


def write_shard(url: str, shard_index: int, samples: list[Mapping[str, Any]], *, layers: list[int],
                dtype: str, compression: str | None = None, hidden_size: int | None = None,
                rejects: Sequence[Mapping[str, Any]] = ()) -> dict:
    """Write one whole shard atomically and return its info (counts, bytes, checksum of every file).

    samples: dicts of numpy arrays: `sample_id` (str), `input_ids` [L], `loss_mask` [L], `hidden_states`
    [n_layers, L, d] in storage form (bf16 as its uint16 bit pattern; for float8_e4m3, the uint8 codes plus
    `hidden_scales` float32 [n_layers, L]). Torch callers go through `pipeline.extract.state_encoding`.
    Safe to call from many processes at once as long as each shard index has one writer.

    `rejects`: rows of the records the producer dropped from this shard after it was formed (extraction's
    non-finite states), kept in its shard.json: a resumed job that keeps the shard still counts them. A
    shard may then hold no sample at all (every one dropped): it is written with empty arrays of width
    `hidden_size`, so that shard numbering, which a resume relies on, never depends on what was dropped.
    """
    if not samples and hidden_size is None:
        raise ValueError(f"shard {shard_index}: no samples to write (give hidden_size for an empty shard)")
    fs, root = fmt.open_fs(url)
    name = fmt.shard_name(shard_index)
    final_dir = fmt.join(root, fmt.SHARDS_DIR, name)
    local = fmt.is_local(fs)
    build_dir = fmt.join(root, fmt.SHARDS_DIR, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}") \
        if local else final_dir
    if not local and fs.exists(final_dir):
        fs.rm(final_dir, recursive=True)  # a partial shard from a crash: no shard.json, so never read
    fs.makedirs(build_dir, exist_ok=True)

    table, parts_by_layer, scales_by_layer, counts = _encode_samples(samples, layers=layers, dtype=dtype,
                                                                     where=name, hidden_size=hidden_size)
    with fs.open(fmt.join(build_dir, fmt.SAMPLES_FILE), "wb") as handle:
        with pa.ipc.new_stream(handle, table.schema) as writer:  # stream format: what `datasets` reads
            writer.write_table(table)
    store = zarr_store(fs, build_dir, read_only=False)
    raw_files = []  # written and hashed together below, never read back
    for index, (layer, parts) in enumerate(zip(layers, parts_by_layer)):
        if scales_by_layer:
            write_scale_array(store, fmt.scale_array_name(layer), scales_by_layer[index], layer=layer)
        if local and compression in (None, "none") and parts:
            raw_files.append(plan_raw_hidden_array(store, build_dir, fmt.hidden_array_name(layer), parts,
                                                   logical_dtype=dtype, layer=layer))
        else:  # compressed, on object storage, or an empty shard ([0, d]: zarr writes only its metadata)
            values = np.concatenate(parts, axis=0) if parts else np.zeros((0, counts["hidden_size"]),
                                                                          fmt.storage_dtype(dtype))
            write_hidden_array(store, fmt.hidden_array_name(layer), values, logical_dtype=dtype, layer=layer,
                               compression=compression)
    hashed = write_raw_files(raw_files)

    files = {}
    for path in sorted(fs.find(build_dir)):
        relative = path[len(build_dir.rstrip("/")) + 1:]
        digest, size = hashed.get(relative) or (fmt.file_checksum(fs, path), fs.size(path))
        files[f"{fmt.SHARDS_DIR}/{name}/{relative}"] = checksum_entry(DEFAULT_CHECKSUM, digest, size)
    info = {"name": name, "index": shard_index, **counts, "bytes": sum(f["bytes"] for f in files.values()),
            "files": files}
    if rejects:
        info["rejects"] = [dict(reject) for reject in rejects]
    atomic.write_bytes(fmt.join(build_dir, fmt.SHARD_INFO), fmt.canonical_json(info), fs=fs)
    if local:
        # An earlier attempt may have committed this shard already: identical content, keep that one.
        atomic.commit_directory(build_dir, final_dir, replace=False)
    log.info("committed %s: %d samples, %d tokens", name, counts["samples"], counts["tokens"])
    return info


def _encode_samples(samples: list[Mapping[str, Any]], *, layers: list[int], dtype: str, where: str,
                    hidden_size: int | None = None) -> tuple[pa.Table, list[list[np.ndarray]], list[np.ndarray], dict]:
    """Validate samples and lay them out: one Arrow table; per layer, the samples' [L_i, d] rows in order
    (left unconcatenated: the raw writer streams them, saving a copy of the shard), and for fp8 and int8 the
    per-token scales of each layer [tokens] (empty otherwise). `hidden_size`, when given, is the width every
    sample must have (and that of an empty shard's arrays)."""
    ids, lengths, offsets, input_ids, loss_masks, hidden, scales = [], [], [], [], [], [], []
    offset = 0
    width = hidden_size
    for position, sample in enumerate(samples):
        label = f"{where} sample {position} ({sample.get('sample_id')!r})"
        tokens = np.asarray(sample["input_ids"]).astype(np.int64, copy=False)
        mask = np.asarray(sample["loss_mask"]).astype(np.uint8, copy=False)
        if dtype in fmt.LOSSY_DTYPES:
            states, token_scales = _coded_arrays(sample, dtype, label)  # [n_layers, L, d] codes, [n_layers, L]
            scales.append(token_scales)
        else:
            states = fmt.to_storage_array(sample["hidden_states"], dtype)
        if tokens.ndim != 1 or mask.shape != tokens.shape:
            raise StoreFormatError(f"{label}: input_ids and loss_mask must be 1-D of equal length, got "
                                   f"{tokens.shape} and {mask.shape}")
        if states.ndim != 3 or states.shape[0] != len(layers) or states.shape[1] != len(tokens):
            raise StoreFormatError(f"{label}: hidden_states must be [n_layers={len(layers)}, L={len(tokens)}, d],"
                                   f" got {list(states.shape)}")
        if width is None:
            width = states.shape[2]
        elif states.shape[2] != width:
            raise StoreFormatError(f"{label}: hidden size {states.shape[2]} differs from {width}")
        if tokens.min(initial=0) < 0 or tokens.max(initial=0) > np.iinfo(np.int32).max:
            raise StoreFormatError(f"{label}: token ids out of int32 range")
        ids.append(str(sample["sample_id"]))
        lengths.append(len(tokens))
        offsets.append(offset)
        input_ids.append(tokens.astype(np.int32))
        loss_masks.append(mask)
        hidden.append(states)
        offset += len(tokens)
    table = pa.Table.from_arrays([
        pa.array(ids, pa.string()),
        pa.array(lengths, pa.int32()),
        pa.array(offsets, pa.int64()),
        _list_array(input_ids, pa.int32()),
        _list_array(loss_masks, pa.uint8()),
    ], schema=SAMPLES_SCHEMA)
    parts = [[states[i] for states in hidden] for i in range(len(layers))]
    layer_scales = [np.concatenate([s[i] for s in scales] or [np.zeros(0, np.float32)]) for i in range(len(layers))] \
        if dtype in fmt.LOSSY_DTYPES else []
    counts = {"samples": len(ids), "tokens": int(offset),
              "loss_tokens": int(sum(int(m.sum()) for m in loss_masks)), "hidden_size": int(width)}
    return table, parts, layer_scales, counts


def _list_array(parts: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts) if parts else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, value_type))


def _coded_arrays(sample: Mapping[str, Any], dtype: str, label: str) -> tuple[np.ndarray, np.ndarray]:
    """The codes and per-token scales of an already encoded sample of a lossy dtype (fp8, int8)."""
    if "hidden_scales" not in sample:
        raise StoreFormatError(f"{label}: {dtype} samples need `hidden_scales` beside the codes; encode them "
                               "with pipeline.extract.state_encoding.encode_codes")
    try:  # fp8: ml_dtypes.float8_e4m3fn (what readers return) or its uint8 bytes; int8: int8
        codes = fmt.storage_view(sample["hidden_states"], dtype)
    except StoreFormatError as error:
        raise StoreFormatError(f"{label}: {error}") from None
    scales = np.asarray(sample["hidden_scales"], dtype=np.float32)
    if scales.shape != codes.shape[:-1]:
        raise StoreFormatError(f"{label}: hidden_scales {list(scales.shape)} must be {list(codes.shape[:-1])}")
    return codes, scales


def committed_shards(url: str, *, remove_damaged: bool = False) -> dict[int, dict]:
    """Infos of the intact shards already committed under `url` (for resuming an interrupted build).

    Every file of a shard is checked against the checksum its shard.json records (sizes alone miss a flipped
    byte). With `remove_damaged` (the build that resumes, holding the store's lock) a damaged shard is
    deleted, so that it is written again: `write_shard` keeps a shard directory it finds in place, which
    is right only for an intact one."""
    fs, root = fmt.open_fs(url)
    shards_dir = fmt.join(root, fmt.SHARDS_DIR)
    if not fs.exists(shards_dir):
        return {}
    found = {}
    for entry in fs.ls(shards_dir, detail=False):
        base = entry.rstrip("/").rsplit("/", 1)[-1]
        if not base.startswith("shard-"):
            continue
        info, damage = _check_committed_shard(fs, root, entry)
        if damage is None:
            found[int(info["index"])] = info
        elif remove_damaged:
            log.warning("shard %s is damaged (%s); deleting it so that it is written again", base, damage)
            fs.rm(entry, recursive=True)
        else:
            log.warning("shard %s is damaged (%s)", base, damage)
    return found


def _check_committed_shard(fs: Any, root: str, shard_dir: str) -> tuple[dict | None, str | None]:
    """(the shard's info, None) when every file it lists has its recorded size and checksum, else
    (info or None, what is wrong)."""
    try:
        info = files.read_json(fs, fmt.join(shard_dir, fmt.SHARD_INFO))
    except StoreFormatError:
        return None, f"its {fmt.SHARD_INFO} is not valid JSON, or not a regular file"
    if info is None:
        return None, f"it has no {fmt.SHARD_INFO}"
    if not isinstance(info, dict) or not isinstance(info.get("files"), dict) or not isinstance(info.get("index"), int):
        return None, f"its {fmt.SHARD_INFO} is not a shard's"
    for relative, meta in sorted(info["files"].items()):
        try:
            fmt.safe_relpath(relative, where=fmt.SHARD_INFO)
            size = int(meta["bytes"])
            algorithm, recorded = entry_checksum(meta, where=fmt.SHARD_INFO)
        except (StoreFormatError, KeyError, TypeError, ValueError):
            return None, f"its {fmt.SHARD_INFO} lists {relative!r} wrongly"
        path = fmt.join(root, relative)
        problem = files.kind_problem(fs, root, relative)
        if problem:
            return info, problem
        if not fs.exists(path):
            return info, f"{relative} is missing"
        if fs.size(path) != size:
            return info, f"{relative} has {fs.size(path)} bytes, {size} recorded"
        digest, read = files.checksum_bounded(fs, root, relative, size, algorithm)
        if read != size or digest != recorded:
            return info, f"{relative} does not match its recorded {algorithm}"
    return info, None


def write_head_bytes(url: str, payload: bytes) -> None:
    """Store the frozen target weights the drafter reuses, as the bytes of a safetensors file.

    The torch side serialises them (`pipeline.extract.state_encoding.write_head`), so the store stays
    torch-free while the file keeps its format (docs/store-format.md)."""
    fs, root = fmt.open_fs(url)
    atomic.write_bytes(fmt.join(root, fmt.HEAD), bytes(payload), fs=fs)


def write_rejects(url: str, rejects: list[Mapping[str, Any]]) -> None:
    """Write `rejects.jsonl`: one JSON object per rejected source record (source, index, reason, ...)."""
    fs, root = fmt.open_fs(url)
    text = "".join(json.dumps(dict(r), sort_keys=True, ensure_ascii=False) + "\n" for r in rejects)
    atomic.write_bytes(fmt.join(root, fmt.REJECTS), text.encode("utf-8"), fs=fs)


def commit_manifest(url: str, *, dataset_id: str, target: dict, tokenizer: dict, capture: dict, source: dict,
                    shards: list[dict], rejected: Mapping[str, int], extra: dict | None = None) -> dict:
    """Write `manifest.json`, last and atomically: from this moment `url` is a complete store."""
    identity = store_identity(target=target, tokenizer=tokenizer, capture=capture, source=source)
    expected_id = fmt.compute_dataset_id(identity)
    if dataset_id != expected_id:
        raise StoreError(f"dataset_id {dataset_id[:12]}… does not match the identity facts "
                         f"({expected_id[:12]}…); compute it with store_identity() + compute_dataset_id()")
    fs, root = fmt.open_fs(url)
    shards = sorted(shards, key=lambda s: s["index"])
    if [s["index"] for s in shards] != list(range(len(shards))):
        raise StoreError(f"{url}: shard indices {[s['index'] for s in shards]} are not 0..{len(shards) - 1}")
    widths = {s["hidden_size"] for s in shards}
    if len(widths) > 1:
        raise StoreFormatError(f"{url}: shards disagree on hidden size: {sorted(widths)}")
    if not fs.exists(fmt.join(root, fmt.HEAD)):
        raise StoreError(f"{url}: {fmt.HEAD} is missing; call write_head_bytes() before commit_manifest()")
    files = {fmt.HEAD: _file_entry(fs, root, fmt.HEAD)}
    if fs.exists(fmt.join(root, fmt.REJECTS)):
        files[fmt.REJECTS] = _file_entry(fs, root, fmt.REJECTS)
    by_reason = dict(sorted(Counter(dict(rejected)).items()))
    manifest = {
        "schema_version": fmt.SCHEMA_VERSION,
        "format_version": fmt.FORMAT_VERSION,
        "dataset_id": dataset_id,
        **identity,
        "hidden_size": widths.pop() if widths else None,
        "layers": list(capture["layers"]),
        "dtype": capture["dtype"],
        "counts": {"samples": sum(s["samples"] for s in shards),
                   "tokens": sum(s["tokens"] for s in shards),
                   "loss_tokens": sum(s["loss_tokens"] for s in shards),
                   "rejected": sum(by_reason.values()),
                   "rejected_by_reason": by_reason},
        "shards": shards,
        "files": files,
        "extra": extra or {},
    }
    atomic.write_bytes(fmt.join(root, fmt.MANIFEST),
                       json.dumps(manifest, indent=1, sort_keys=True).encode(), fs=fs)
    _remove_leftovers(fs, root)
    return manifest


def write_store(url: str, samples: Iterable[Mapping[str, Any]], *, head: bytes, target: dict,
                tokenizer: dict, capture: dict, source: dict, rejects: list[Mapping[str, Any]] | None = None,
                samples_per_shard: int = 1024, overwrite: bool = False, compression: str | None = None) -> dict:
    """Write a whole store in one process: shards of `samples_per_shard`, head, rejects, manifest.

    samples as for `write_shard`; head: the safetensors bytes of `write_head_bytes`. The convenience path
    for tests, tools and small jobs; extraction uses the same pieces in parallel. The codec is recorded in
    `capture["compression"]` (when not none), as extract records it; `compression` None takes it from there.
    """
    compression = compression or capture.get("compression")
    if compression not in (None, "none"):
        capture = {**capture, "compression": compression}
    with store_lock(url):
        identity = store_identity(target=target, tokenizer=tokenizer, capture=capture, source=source)
        dataset_id = fmt.compute_dataset_id(identity)
        if begin_store(url, dataset_id, overwrite=overwrite, command="write_store") == "complete":
            raise StoreConflictError(f"{url} is already a complete store of this data; delete it to rebuild it")
        shards = []
        for batch in _batched(samples, samples_per_shard):
            shards.append(write_shard(url, len(shards), batch, layers=capture["layers"], dtype=capture["dtype"],
                                      compression=compression))
        write_head_bytes(url, head)
        rejected = Counter(str(r.get("reason", "unknown")) for r in rejects or [])
        if rejects:
            write_rejects(url, rejects)
        return commit_manifest(url, dataset_id=dataset_id, target=target, tokenizer=tokenizer, capture=capture,
                               source=source, shards=shards, rejected=rejected)


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _file_entry(fs: Any, root: str, relative: str) -> dict:
    path = fmt.join(root, relative)
    return checksum_entry(DEFAULT_CHECKSUM, fmt.file_checksum(fs, path), fs.size(path))


def _remove_leftovers(fs: Any, root: str) -> None:
    """Drop the pending marker and temporary shard folders of crashed attempts."""
    pending = fmt.join(root, fmt.PENDING)
    if fs.exists(pending):
        fs.rm(pending)
    for entry in fs.ls(fmt.join(root, fmt.SHARDS_DIR), detail=False):
        if ".tmp-" in entry.rsplit("/", 1)[-1]:
            fs.rm(entry, recursive=True)
