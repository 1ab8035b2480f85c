"""The records of a job's inputs as a stream: one pass that only counts (for the job's identity), then one
that reads them for good, lazily, checked against the first.

A job's identity (extract's dataset_id, regenerate's output identity) hashes every input and counts its
records, and must be known before the job claims its output; holding the records to know it would make the
driver's memory grow with the inputs. So `scan_records` reads once keeping counts only, and
`stream_records` reads again as the job goes. Between the two passes a file could change (still being
written, replaced): `refuse_changed` (before work starts on more records) and `check_unchanged` (once the
stream is read to its end) refuse to commit output made from bytes other than those hashed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from beagle.records import (DEFAULT_MAX_RECORD_BYTES, RejectReason, RejectRecord, check_data_path, iter_raw_records,
                            record_turns)
from pipeline.jobkit.rejects import count_reasons
from pipeline.store.hashing import update_from_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputScan:
    """What one pass over the inputs learns without keeping a record: the facts the job's identity needs
    before anything is written, how many records reach the job, and where the first conversation is."""

    sources: list[dict[str, Any]]  # {"path", "sha256", "records"} per input, as RecordStream reports them
    records: int  # usable records
    conversations: bool  # some usable record is a conversation (the target needs a chat template)
    identities: list[list[tuple]] = field(default_factory=list)  # file_identity of each input, before hashing
    first_conversation: dict[str, Any] | None = None  # {"source", "index"} of the first conversation
    rejected_by_reason: dict[str, int] = field(default_factory=dict)  # rejects of reading, by reason


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory's files (relative names and bytes, in sorted order)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        update_from_file(digest, file)
    return digest.hexdigest()


def file_identity(path: Path) -> list[tuple]:
    """What changes whenever a file's bytes may have: device, inode, size, mtime and ctime (ctime cannot
    be set back by hand), of the file or of each file of a directory. Taken before a file is hashed and
    again before the store is committed: equal, the bytes read are the bytes hashed."""
    files = [path] if not path.is_dir() else sorted(p for p in path.rglob("*") if p.is_file())
    identity = []
    for file in files:
        info = file.stat()
        identity.append((str(file), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return identity


class InputChangedError(ValueError):
    """An input file changed while a job read it: what was made from it cannot be trusted."""


def changed_inputs(scan: InputScan) -> list[str]:
    """The inputs whose file identity is no longer what it was when `scan` hashed them."""
    return [source["path"] for source, identity in zip(scan.sources, scan.identities)
            if file_identity(Path(source["path"])) != identity]


def refuse_changed(scan: InputScan, *, job: str, output: str) -> None:
    """Raise InputChangedError if an input was replaced or rewritten since `scan` hashed it (a stat per
    input: cheap enough to check before each chunk is handed to the actors). `output`: what would record
    the wrong sha256 ("the store", "the output")."""
    changed = changed_inputs(scan)
    if changed:
        raise InputChangedError(f"--data {changed[0]}: changed while {job} ran (replaced or rewritten after it was "
                                f"hashed), so {output} would record the sha256 of other bytes than it holds; "
                                "nothing was committed from it: rerun once the inputs are final")


def check_unchanged(scan: InputScan, stream: "RecordStream", *, job: str, output: str) -> None:
    """Once `stream` has been read to its end: each file's record count, and its identity (inode, size,
    mtime, ctime: `file_identity`, taken before it was hashed), must be what the scan saw."""
    for before, after in zip(scan.sources, stream.sources):
        if before["records"] != after["records"]:
            raise InputChangedError(f"--data {before['path']}: changed while it was read ({before['records']} "
                                    f"records, then {after['records']}); rerun once it is complete")
    refuse_changed(scan, job=job, output=output)


def scan_records(paths: list[str], normalize: Callable[..., Any], *, is_conversation: Callable[[Any], bool],
                 limit: int | None = None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 max_turns: int | None = None) -> InputScan:
    """Read the inputs once, keeping only counts (and where the first conversation is)."""
    stream = RecordStream(paths, normalize, limit=limit, max_record_bytes=max_record_bytes, max_turns=max_turns)
    first = None
    for record in stream:
        if first is None and is_conversation(record):
            first = {"source": record.source, "index": record.index}
    return InputScan(stream.sources, stream.records, first is not None, stream.identities, first,
                     count_reasons(stream.rejects))


def stream_records(paths: list[str], normalize: Callable[..., Any], scan: InputScan, *, limit: int | None = None,
                   max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_turns: int | None = None) -> "RecordStream":
    """The records `scan` counted, read again lazily (the files are not hashed a second time)."""
    return RecordStream(paths, normalize, limit=limit, max_record_bytes=max_record_bytes, max_turns=max_turns,
                        digests=[source["sha256"] for source in scan.sources])


class RecordStream:
    """The usable records of the inputs, in input order, read lazily: one pass over the files per iteration.

    `normalize(obj, source=, index=, default_id=)` turns one raw record into a frozen dataclass with
    `sample_id` and `line` fields, or raises `beagle.records.RejectRecord`; a record
    whose id was already seen is rejected as `duplicate_id`. Reading stops once `limit` records are usable.
    While it is iterated, `rejects` collects the rejected records and `sources` each finished file's
    {"path", "sha256", "records"} (records read from it, rejects included): what the dataset_id hashes.
    What the stream keeps grows with the rejects and the set of ids seen, never with the records.

    `digests`: the files' sha256 from an earlier pass over the same inputs, so a second pass (extraction
    scans its inputs once before it reads them for good) does not hash every file again.
    """

    def __init__(self, paths: list[str], normalize: Callable[..., Any], *, limit: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_turns: int | None = None,
                 digests: list[str] | None = None) -> None:
        self.paths = list(paths)
        self.checked = [check_data_path(p) for p in paths]  # a missing or unreadable input fails at once
        self.normalize = normalize
        self.limit = limit
        self.max_record_bytes = max_record_bytes
        self.max_turns = max_turns
        self.digests = digests
        self.rejects: list[dict[str, Any]] = []
        self.sources: list[dict[str, Any]] = []
        self.identities: list[list[tuple]] = []  # file_identity of each input, taken before it was hashed
        self.records = 0  # usable records yielded so far

    def __iter__(self) -> Iterator[Any]:
        self.rejects, self.sources, self.identities, self.records = [], [], [], 0
        names = [p.name for p in self.checked]
        seen_ids: set[str] = set()
        for k, (given, path) in enumerate(zip(self.paths, self.checked)):
            self.identities.append(file_identity(path))
            digest = self.digests[k] if self.digests is not None else sha256_path(path)
            # Ids derived from position use the file name, or its hash when two inputs share a name.
            prefix = path.name if names.count(path.name) == 1 else f"{path.name}@{digest[:8]}"
            count = 0
            for index, obj, unreadable, line in iter_raw_records(path, max_record_bytes=self.max_record_bytes):
                if self.limit is not None and self.records >= self.limit:
                    break
                count += 1
                record = self._record(obj, unreadable, source=given, index=index, line=line,
                                      default_id=f"{prefix}:{index}", seen_ids=seen_ids)
                if record is not None:
                    seen_ids.add(record.sample_id)
                    self.records += 1
                    yield record
            self.sources.append({"path": given, "sha256": digest, "records": count})
            logger.info("read %s: %d records", given, count)

    def _record(self, obj: Any, unreadable: RejectRecord | None, *, source: str, index: int, line: int | None,
                default_id: str, seen_ids: set[str]) -> Any:
        """One raw record -> the normalised record, or None after adding its reject to `rejects`."""
        where: dict[str, Any] = {"source": source, "index": index}
        if line is not None:
            where["line"] = line
        try:
            if unreadable is not None:
                raise unreadable
            turns = record_turns(obj)
            if self.max_turns is not None and turns > self.max_turns:
                raise RejectRecord(RejectReason.TOO_MANY_TURNS,
                                   f"{turns:,} turns, more than --max-turns {self.max_turns:,}")
            record = self.normalize(obj, source=source, index=index, default_id=default_id)
            if record.sample_id in seen_ids:
                raise RejectRecord(RejectReason.DUPLICATE_ID, f"id {record.sample_id!r} seen before")
        except RejectRecord as reject:
            self.rejects.append(reject.as_dict(**where))
            return None
        return dataclasses.replace(record, line=line) if line is not None else record
