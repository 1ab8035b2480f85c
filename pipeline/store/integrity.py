"""Integrity checks shared by the reader (checks on open and on first read) and `verify` (all of them).

One place computes what "this file is the one the manifest lists" and "the manifest is the one the
producer wrote" mean, so that `verify`, `open_store(verify="first-read")` and the trainer agree.
Each check returns a one-line problem naming the file (relative to the store root), or None.

What they prove: a flipped or truncated byte, a missing or extra-replaced file, a shard copied in from
another store and an identity section edited by hand are all detected. What they cannot prove: that a
manifest whose checksums were rewritten to match forged files is authentic (the manifest is not signed).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.store import files
from pipeline.store import format as fmt
from pipeline.store.errors import StoreFormatError
from pipeline.store.hashing import bytes_checksum, entry_checksum

# Modes of `open_store(verify=...)`.
VERIFY_NONE = "none"
VERIFY_FIRST_READ = "first-read"
VERIFY_MODES = (VERIFY_NONE, VERIFY_FIRST_READ)


def listed_files(manifest: dict) -> dict[str, dict]:
    """Every file the manifest lists, `{relative path: {"bytes", ALGORITHM}}` (top-level files, then shards)."""
    files = dict(manifest["files"])
    for shard in manifest["shards"]:
        files.update(shard["files"])
    return files


def identity_problem(manifest: dict) -> str | None:
    """The dataset_id must be the hash of the identity facts the manifest records, and the copies of
    those facts at the top level must agree with them: catches a manifest edited by hand."""
    from pipeline.store.writer import store_identity

    identity = store_identity(target=manifest.get("target"), tokenizer=manifest.get("tokenizer"),
                              capture=manifest.get("capture"), source=manifest.get("source"))
    if fmt.compute_dataset_id(identity) != manifest.get("dataset_id"):
        return f"{fmt.MANIFEST}: dataset_id does not match the recorded inputs (the manifest was edited)"
    capture = manifest.get("capture") or {}
    for key in ("layers", "dtype"):
        if key in capture and manifest.get(key) != capture[key]:
            return (f"{fmt.MANIFEST}: {key} {manifest.get(key)!r} differs from capture.{key} {capture[key]!r} "
                    "(the manifest was edited)")
    return None


def count_problems(manifest: dict) -> list[str]:
    """`counts` must be the sum of the shards' counts."""
    problems = []
    counts = manifest["counts"]
    for key in ("samples", "tokens", "loss_tokens"):
        total = sum(int(s[key]) for s in manifest["shards"])
        if total != counts.get(key):
            problems.append(f"{fmt.MANIFEST}: counts.{key} is {counts.get(key)}, shards add up to {total}")
    return problems


def table_problems(table: Mapping[str, Any], info: dict, *, vocab_size: int | None, where: str) -> list[str]:
    """The structure of one shard's sample table, which checksums cannot vouch for (a store rewritten with
    its checksums fixed passes them): every sample's tokens, mask and states lie where `length` says, laid
    back to back as the writer lays them (so no two overlap and none reaches past the shard's states),
    token ids in [0, vocab_size), mask values in {0, 1}, sample ids unique, counts those of the manifest.
    `table` as `_Shard.read_table` gives it; `where` names the file. Vectorised: a pass over the table."""
    problems = []
    lengths = np.asarray(table["length"], dtype=np.int64)
    offsets = np.asarray(table["token_offset"], dtype=np.int64)
    input_ids, loss_mask = table["input_ids"], table["loss_mask"]
    if len(input_ids) and int(input_ids.min()) < 0:
        problems.append(f"{where}: a negative token id ({int(input_ids.min())})")
    if vocab_size and len(input_ids) and int(input_ids.max()) >= int(vocab_size):
        problems.append(f"{where}: token id {int(input_ids.max())} >= the vocabulary size {vocab_size}")
    if len(loss_mask) and int(loss_mask.max()) > 1:
        problems.append(f"{where}: loss_mask value {int(loss_mask.max())}, not 0 or 1")
    if len(lengths) and int(lengths.min()) < 0:
        problems.append(f"{where}: a negative length ({int(lengths.min())})")
    if not np.array_equal(np.diff(table["list_offsets"]), lengths) or \
            not np.array_equal(np.diff(table["mask_offsets"]), lengths):
        problems.append(f"{where}: input_ids/loss_mask lengths differ from `length`")
    expected = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    bad = np.flatnonzero(offsets != expected)
    if len(bad):
        row = int(bad[0])
        problems.append(f"{where}: sample {row} ({table['sample_id'][row]!r}) has token_offset {int(offsets[row])}, "
                        f"not {int(expected[row])}: its states would overlap another sample's or lie outside "
                        "the shard's")
    if int(lengths.sum()) != info["tokens"]:
        problems.append(f"{where}: lengths sum to {int(lengths.sum())}, the manifest says {info['tokens']} tokens")
    if int(np.asarray(loss_mask, dtype=np.int64).sum()) != info["loss_tokens"]:
        problems.append(f"{where}: loss tokens differ from the manifest")
    ids = table["sample_id"]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        duplicate = next(i for i in ids if i in seen or seen.add(i))
        problems.append(f"{where}: sample id {duplicate!r} appears more than once")
    return problems


def duplicate_id_problem(ids_by_shard: list[tuple[str, list[str]]]) -> str | None:
    """Sample ids must be unique across a store's shards: the first one seen in two shards, named."""
    first_shard: dict[str, str] = {}
    for shard, ids in ids_by_shard:
        for sample_id in set(ids):
            if sample_id in first_shard:
                return f"sample id {sample_id!r} appears in {first_shard[sample_id]} and in {shard}"
            first_shard[sample_id] = shard
    return None


def size_problem(relative: str, size: int | None, meta: dict) -> str | None:
    """A listed file must exist and have the size the manifest records."""
    if size is None:
        return f"{relative}: missing"
    if size != meta["bytes"]:
        return f"{relative}: {size} bytes, manifest says {meta['bytes']} (truncated or replaced)"
    return None


def link_problem(fs: Any, root: str, relative: str) -> str | None:
    """On local disk, a listed file must not be a link resolving outside the store (manifest paths are
    already plain relative paths; this closes the symlink route to reading someone else's files), nor a
    device, FIFO, socket or directory (reading one never ends, or blocks). Stats only, opens nothing."""
    return files.kind_problem(fs, root, relative)


def file_problem(fs: Any, root: str, relative: str, meta: dict) -> tuple[str | None, int]:
    """Check one listed file completely (presence, kind, size, checksum), reading at most its recorded size
    plus one byte. Returns (problem, bytes read)."""
    path = fmt.join(root, relative)
    problem = files.kind_problem(fs, root, relative)
    if problem:
        return problem, 0
    size = fs.size(path) if fs.exists(path) else None
    problem = size_problem(relative, size, meta)
    if problem is None:
        try:
            algorithm, recorded = entry_checksum(meta, where=relative)
            digest, read = files.checksum_bounded(fs, root, relative, meta["bytes"], algorithm)
        except StoreFormatError as error:  # swapped for a FIFO or a link since the check above
            return str(error), 0
        except FileNotFoundError:
            return f"{relative}: missing", 0
        if read != meta["bytes"]:
            problem = f"{relative}: {read} bytes read, manifest says {meta['bytes']} (changed while read)"
        elif digest != recorded:
            problem = f"{relative}: {algorithm} mismatch (corrupted, or copied from another store)"
    return problem, size or 0


def bytes_problem(relative: str, payload: bytes, meta: dict) -> str | None:
    """Check bytes already read into memory against their manifest entry (no second read)."""
    problem = size_problem(relative, len(payload), meta)
    if problem is None:
        algorithm, recorded = entry_checksum(meta, where=relative)
        if bytes_checksum(payload, algorithm) != recorded:
            problem = f"{relative}: {algorithm} mismatch (corrupted, or copied from another store)"
    return problem


class StoreIntegrityError(StoreFormatError):
    """A store's bytes are not the ones its manifest lists (corrupted, truncated, replaced, edited)."""


def raise_first(problems: list[str | None], url: str) -> None:
    """Raise StoreIntegrityError for the first problem, with the fix, if there is one."""
    for problem in problems:
        if problem:
            raise StoreIntegrityError(f"{url}: {problem}; run `beagle-pipeline verify {url}` for a full report "
                                      "and rebuild or re-copy the store (training never uses unverified bytes)")
