"""`verify`: recompute every checksum and check counts, lengths and finiteness of a store."""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline.store import files
from pipeline.store import format as fmt
from pipeline.store import integrity
from pipeline.store import quantized
from pipeline.store.errors import StoreError
from pipeline.store.reader import FeatureStore

log = logging.getLogger(__name__)

# bf16 bit pattern: exponent all ones means inf or nan.
_BF16_EXPONENT = np.uint16(0x7F80)


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    # Files under the store that no manifest lists, {relative path: bytes}: never read, so not a problem
    # of the store, but worth deleting (a crashed writer's leftovers, a copy gone wrong).
    unlisted: dict[str, int] = field(default_factory=dict)
    # Top-level manifest keys this format does not define: ignored by every reader, so noted, not a problem.
    unknown_keys: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(url: str, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check a store end to end. Never raises for damage it can describe: problems are listed instead.

    `progress` is called with the byte count of each file checked (for a progress bar).
    """
    report = VerifyReport()
    try:
        store = FeatureStore(url, check_files=False)
    except StoreError as error:
        report.problems.append(str(error))
        return report
    fs, root, manifest = store.fs, store.root, store.manifest

    problem = integrity.identity_problem(manifest)
    if problem:
        report.problems.append(problem)
    for relative, meta in sorted(integrity.listed_files(manifest).items()):
        problem = integrity.link_problem(fs, root, relative)  # never read through a link leaving the store
        size = 0
        if problem is None:
            problem, size = integrity.file_problem(fs, root, relative, meta)
        if problem:
            report.problems.append(problem)
        if size:
            report.files_checked += 1
            report.bytes_checked += size
            if progress:
                progress(size)
    for shard in manifest["shards"]:  # each shard's commit marker: unlisted, yet a FIFO there must not pass
        problem = integrity.link_problem(fs, root, f"{fmt.SHARDS_DIR}/{shard['name']}/{fmt.SHARD_INFO}")
        if problem:
            report.problems.append(problem)
    report.problems.extend(integrity.count_problems(manifest))
    report.problems.extend(_listing_problems(store))
    report.problems.extend(_rejects_problems(store))
    report.unlisted = _unlisted_files(store)
    report.unknown_keys = sorted(set(manifest) - fmt.MANIFEST_KEYS)
    if report.problems:  # content checks below would only repeat checksum failures more noisily
        return report
    ids_by_shard = []
    for shard in store._shards:
        where = f"{fmt.SHARDS_DIR}/{shard.info['name']}"
        try:
            table = shard.read_table()
            ids_by_shard.append((where, table["sample_id"]))
            problems = shard.table_problems(table)
            report.problems.extend(problems)
            if not problems:  # states are checked only where the table says where they lie
                _check_shard_states(store, shard, where, report)
        except Exception as error:  # a damaged file can fail in many library-specific ways
            report.problems.append(f"{where}: unreadable ({type(error).__name__}: {error})")
    problem = integrity.duplicate_id_problem(ids_by_shard)
    if problem:
        report.problems.append(problem)
    return report


def _listing_problems(store: FeatureStore) -> list[str]:
    """Each shard must list its sample table and every array its capture settings call for: a shard
    whose listing lacks one was written incompletely, and checksums of the files it does list cannot tell."""
    arrays = [fmt.hidden_array_name(layer) for layer in store.layers]
    if store.dtype in fmt.LOSSY_DTYPES:
        arrays += [fmt.scale_array_name(layer) for layer in store.layers]
    problems = []
    for shard in store.manifest["shards"]:
        prefix = f"{fmt.SHARDS_DIR}/{shard['name']}"
        wanted = [f"{prefix}/{fmt.SAMPLES_FILE}"] + [f"{prefix}/{name}/zarr.json" for name in arrays]
        missing = [name for name in wanted if name not in shard["files"]]
        if missing:
            problems.append(f"{prefix}: the manifest does not list {', '.join(missing)} (an incomplete shard; "
                            "extract it again)")
    return problems


def _rejects_problems(store: FeatureStore) -> list[str]:
    """The rejected counts of the manifest must be what `rejects.jsonl` holds, reason by reason."""
    counts = store.manifest["counts"]
    recorded = Counter()
    listed = store.manifest["files"].get(fmt.REJECTS)
    if listed is not None:  # an unlisted rejects.jsonl is never read (reported as unlisted)
        try:
            payload = files.read_bounded(store.fs, store.root, fmt.REJECTS, listed["bytes"])
        except (OSError, StoreError):  # missing, not a regular file, too long: the checksum pass says which
            return []
        if payload:
            for number, line in enumerate(payload.decode("utf-8", errors="replace").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    recorded[str(json.loads(line).get("reason", "unknown"))] += 1
                except (ValueError, AttributeError, RecursionError):
                    return [f"{fmt.REJECTS} line {number}: not a JSON object"]
    expected = Counter({k: int(v) for k, v in (counts.get("rejected_by_reason") or {}).items() if int(v)})
    problems = []
    if recorded != expected:
        problems.append(f"{fmt.REJECTS}: holds {dict(sorted(recorded.items()))} rejected records, the manifest "
                        f"counts {dict(sorted(expected.items()))}")
    if int(counts.get("rejected", 0)) != sum(expected.values()):
        problems.append(f"{fmt.MANIFEST}: counts.rejected is {counts.get('rejected')}, its reasons add up to "
                        f"{sum(expected.values())}")
    return problems


def _unlisted_files(store: FeatureStore) -> dict[str, int]:
    """Files under the store that no manifest lists (the manifest, the lock and each shard's own
    shard.json excepted)."""
    listed = set(integrity.listed_files(store.manifest))
    listed |= {fmt.MANIFEST, fmt.LOCK, fmt.LOCK_OBJECT} | {f"{fmt.SHARDS_DIR}/{s['name']}/{fmt.SHARD_INFO}"
                                         for s in store.manifest["shards"]}
    root = store.root.rstrip("/")
    found = {}
    for path, info in store.fs.find(root, detail=True).items():
        relative = path[len(root) + 1:]
        if relative not in listed:
            found[relative] = int(info.get("size") or 0)
    return dict(sorted(found.items()))


def _check_shard_states(store: FeatureStore, shard, where: str, report: VerifyReport) -> None:
    """Every state array has the shape the manifest records and holds only finite values."""
    for layer, array in zip(store.layers, shard.hidden):
        name = f"{where}/{fmt.hidden_array_name(layer)}"
        if tuple(array.shape) != (shard.info["tokens"], store.hidden_size):
            report.problems.append(f"{name}: shape {tuple(array.shape)}, expected "
                                   f"({shard.info['tokens']}, {store.hidden_size})")
            continue
        step = max(1, (64 << 20) // max(1, store.hidden_size * 4))
        for start in range(0, array.shape[0], step):
            block = np.asarray(array[start:start + step])
            if store.dtype == "bfloat16":
                bad = np.count_nonzero((block & _BF16_EXPONENT) == _BF16_EXPONENT)
            elif store.dtype in fmt.LOSSY_DTYPES:
                bad = quantized.non_finite_count(store.dtype, block)
            else:
                bad = block.size - np.count_nonzero(np.isfinite(block))
            if bad:
                report.problems.append(f"{name}: {bad} non-finite values in rows {start}..{start + len(block) - 1}")
                break
    if store.dtype in fmt.LOSSY_DTYPES:  # value = code x scale: a non-finite scale makes its whole row NaN
        for layer, scales in zip(store.layers, shard.scales):
            bad_rows = np.flatnonzero(~np.isfinite(scales))
            if bad_rows.size:
                report.problems.append(f"{where}/{fmt.scale_array_name(layer)}: {bad_rows.size} non-finite scales "
                                       f"(rows {int(bad_rows[0])}..): those tokens decode as NaN; the target's "
                                       "states overflowed, re-extract in a wider --dtype")
