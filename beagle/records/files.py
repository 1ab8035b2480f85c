"""Input files -> raw records, with a reject (file, line, reason) for each record that cannot be read.

One reader for every command: JSON arrays (through `ijson`, `beagle.records.json_arrays`), JSONL, Parquet
and `datasets` directories, read in bounded memory, so that a malformed line becomes a reject instead of
killing a job. What a record *means* (a conversation to tokenize, prompts to answer) is decided by
`beagle.records.messages.parse_record` and each command's use of it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from beagle.errors import InputError
from beagle.records.json_arrays import UTF8_BOM, JsonArrayError, json_array_items
from beagle.records.reasons import DEFAULT_MAX_RECORD_BYTES, RejectReason, RejectRecord

LINE_BLOCK_BYTES = 1 << 20  # bytes read at a time while skipping the rest of a line over the size limit
SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet")  # and a `datasets` save_to_disk directory


def check_data_path(path: str | Path, flag: str = "--data") -> Path:
    """Fail at once, naming the file (and the flag that gave it), if an input cannot be read at all."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{flag} {path}: no such file or directory")
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise InputError(f"{flag} {path}: unknown format {p.suffix!r}; use .json, .jsonl, .parquet "
                             "or a `datasets` save_to_disk directory")
        if not os.access(p, os.R_OK):
            raise InputError(f"{flag} {path}: not readable")
    return p


def iter_raw_records(path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, flag: str = "--data",
                     ) -> Iterator[tuple[int, Any, RejectRecord | None, int | None]]:
    """Yield (index, raw object, reject or None, line number or None) for every record of one input.

    JSONL is read as bytes, line by line: a line over `max_record_bytes` is rejected unread, one that is
    not UTF-8 is rejected (not patched with replacement characters), then it is parsed. A row of any other
    format (a JSON array's element, built one at a time; a Parquet or `datasets` row) whose text passes
    `max_record_bytes` is rejected as too_large; a file that is not one valid JSON array raises `InputError`
    after the elements before the fault, since no line boundary tells where the next good record starts."""
    if path.is_dir() or path.suffix.lower() == ".parquet" or (path.suffix.lower() == ".json" and _starts_array(path)):
        for i, row in enumerate(_rows(path, max_record_bytes, flag)):
            size = 0 if isinstance(row, RejectRecord) else text_bytes(row)
            if size > max_record_bytes:
                row = RejectRecord(RejectReason.TOO_LARGE, f"{size:,} bytes of text, more than --max-record-bytes "
                                   f"{max_record_bytes:,}")
            yield (i, None, row, None) if isinstance(row, RejectRecord) else (i, row, None, None)
        return
    with open(path, "rb") as handle:  # bytes: a line's size is checked before it is decoded or parsed
        for i, (raw, size) in enumerate(bounded_lines(handle, max_record_bytes)):
            if raw is None:
                yield i, None, RejectRecord(RejectReason.TOO_LARGE, f"line {i + 1}: {size:,} bytes, more than "
                                            f"--max-record-bytes {max_record_bytes:,}"), i + 1
                continue
            if i == 0:
                raw = raw.removeprefix(UTF8_BOM)  # a BOM opens the file, not the first record
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, None, RejectRecord(RejectReason.INVALID_UTF8,
                                            f"line {i + 1}: byte {exc.start} is not UTF-8"), i + 1
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, int too long, nesting too deep
                yield i, None, RejectRecord(RejectReason.MALFORMED_JSON, f"line {i + 1}: {_parse_error(exc)}"), i + 1
                continue
            yield i, obj, None, i + 1


def _rows(path: Path, max_record_bytes: int, flag: str) -> Iterator[Any]:
    """The rows of a `datasets` directory, a Parquet file or a JSON array, in order (a JSON array element
    too deep or too large to build comes as its RejectRecord)."""
    if path.is_dir():
        import datasets
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - datasets raises several types here
            raise InputError(f"{flag} {path}: not a `datasets` directory made by save_to_disk ({exc})") from None
        if isinstance(data, datasets.DatasetDict):
            raise InputError(f"{flag} {path}: is a DatasetDict with splits {list(data)}; pass one split "
                             f"directory, e.g. {path / next(iter(data))}")
        yield from data
    elif path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
            for batch in batches:
                yield from batch.to_pylist()
        except (pa.ArrowException, OSError) as exc:  # a damaged or non-Parquet file
            raise InputError(f"{flag} {path}: not a readable Parquet file ({str(exc).splitlines()[0]}); fix or "
                             "re-export it") from None
    else:
        try:
            # elements a little over the limit are still built, and rejected as too_large by the caller
            yield from json_array_items(path, max_element_bytes=4 * max_record_bytes)
        except JsonArrayError as exc:
            raise InputError(f"{flag} {path}: not valid JSON ({exc}); fix the file or convert it to JSONL, where "
                             "a bad line is rejected on its own") from None


def _starts_array(path: Path) -> bool:
    """A .json file holding one array (else it is read as JSON Lines, one object per line)."""
    with open(path, "rb") as probe:
        return probe.read(4096).removeprefix(UTF8_BOM).lstrip().startswith(b"[")


def bounded_lines(handle: Any, limit: int, block_bytes: int = LINE_BLOCK_BYTES) -> Iterator[tuple[bytes | None, int]]:
    """(line, its size in bytes) for each line of a binary file, its newline included; a line of more than
    `limit` bytes comes as (None, size), having been read in blocks and dropped, never held whole (a file
    of gigabytes with no newline costs `limit` plus a block of memory, not gigabytes)."""
    while True:
        raw = handle.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit:
            yield raw, len(raw)
            continue
        size = len(raw)
        while not raw.endswith(b"\n"):
            raw = handle.readline(block_bytes)
            if not raw:
                break
            size += len(raw)
        yield None, size


def record_turns(obj: Any) -> int:
    """The turns of a raw conversation record (0 for anything else), counted before they are normalised."""
    if not isinstance(obj, dict):
        return 0
    turns = next((obj[key] for key in ("conversations", "messages", "turns") if obj.get(key) is not None), None)
    return len(turns) if isinstance(turns, list) else 0


def text_bytes(value: Any) -> int:
    """Bytes of the strings in a parsed row (UTF-8 length bound: 4 per character), iteratively."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += 4 * len(item) if not item.isascii() else len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _parse_error(exc: Exception) -> str:
    """A short reason for a record the JSON parser refused (hostile input must not crash the reader)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return getattr(exc, "msg", None) or str(exc)[:200]
