"""Reading input files into raw records, with a reject (file, line, reason) for each one that cannot be read.

Shared by every job over records (`extract`, `regenerate`): JSON arrays, JSONL, Parquet and `datasets`
directories, read on the driver in bounded memory, where a malformed line can become a reject instead of
killing a Ray task. What a record *means* (a conversation to tokenize, prompts to answer) is the job's
`normalize` function; the stream that applies it is `pipeline.jobkit.record_stream`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from pipeline.store.hashing import update_from_file

logger = logging.getLogger(__name__)

# Reasons the reader itself rejects a record for; each job's table (a `RejectRecord` subclass) adds its own.
READ_REJECT_REASONS: dict[str, str] = {
    "malformed_json": "a JSONL line that does not parse as JSON",
    "invalid_utf8": "a JSONL line whose bytes are not valid UTF-8 (never silently replaced)",
    "too_large": "a record larger than --max-record-bytes (rejected before it is parsed or tokenized)",
    "too_many_turns": "a conversation of more turns than --max-turns (rejected before it is tokenized)",
    "duplicate_id": "a record whose `id` was already seen in the inputs",
}

# Large enough for any real conversation (a 1 MB message passes), small enough that one bad line cannot
# exhaust a tokenize worker's memory.
DEFAULT_MAX_RECORD_BYTES = 32 << 20
# Turns of one conversation at most. Finding loss masks costs time that grows faster than the number of
# turns on some templates (transformers' generation-marker path joins strings per block: 10^5 one-character
# turns took 81 s); real conversations have tens of turns, ShareGPT's longest a few hundred.
DEFAULT_MAX_TURNS = 1024
LINE_BLOCK_BYTES = 1 << 20  # bytes read at a time while skipping the rest of a line over the size limit


class RejectRecord(Exception):
    """Raised while normalising one record; carries the reject reason key and a short detail."""

    reasons: dict[str, str] = READ_REJECT_REASONS  # the keys a reason may take (a job's subclass brings its table)

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in self.reasons, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory's files (relative names and bytes, in sorted order)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        update_from_file(digest, file)
    return digest.hexdigest()


def iter_raw_records(path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                     ) -> Iterator[tuple[int, Any, RejectRecord | None, int | None]]:
    """Yield (index, raw object, reject or None, line number or None) for every record.

    JSONL is read as bytes, line by line: a line over `max_record_bytes` is rejected unread, one that is
    not UTF-8 is rejected (not patched with replacement characters), then it is parsed."""
    if path.is_dir():
        import datasets
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - datasets raises several types here
            raise ValueError(f"--data {path}: not a `datasets` directory made by save_to_disk ({exc})") from None
        if isinstance(data, datasets.DatasetDict):
            raise ValueError(f"--data {path}: is a DatasetDict with splits {list(data)}; pass one split "
                             f"directory, e.g. {path / next(iter(data))}")
        for i, row in enumerate(data):
            yield i, row, None, None
        return
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield index, row, None, None
                index += 1
        return
    if suffix == ".json":
        with open(path, "rb") as probe:
            is_array = probe.read(4096).lstrip().startswith(b"[")
        if is_array:
            try:
                # elements a little over the limit are still read, and rejected as too_large record by record
                for i, row in enumerate(json_array_items(path, max_element_chars=4 * max_record_bytes)):
                    yield i, row, None, None
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, int too long, nesting
                raise ValueError(f"--data {path}: not valid JSON ({_parse_error(exc)}); fix the file or convert "
                                 "it to JSONL, where a bad line is rejected on its own") from None
            return
    with open(path, "rb") as handle:  # bytes: a line's size is checked before it is decoded or parsed
        for i, (raw, size) in enumerate(bounded_lines(handle, max_record_bytes)):
            if raw is None:
                yield i, None, RejectRecord("too_large", f"line {i + 1}: {size:,} bytes, more than "
                                            f"--max-record-bytes {max_record_bytes:,}"), i + 1
                continue
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, None, RejectRecord("invalid_utf8", f"line {i + 1}: byte {exc.start} is not UTF-8"), i + 1
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, int too long, nesting too deep
                yield i, None, RejectRecord("malformed_json", f"line {i + 1}: {_parse_error(exc)}"), i + 1
                continue
            yield i, obj, None, i + 1


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


def _turns(obj: Any) -> int:
    """The turns of a raw conversation record (0 for anything else), counted before they are normalised."""
    if not isinstance(obj, dict):
        return 0
    turns = obj.get("conversations") if obj.get("conversations") is not None else obj.get("messages")
    return len(turns) if isinstance(turns, list) else 0


def _text_bytes(value: Any) -> int:
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


JSON_BLOCK_CHARS = 1 << 20  # characters read at a time from a .json array
_WHITESPACE = frozenset(" \t\n\r")
_ELEMENT_ENDS = _WHITESPACE | {",", "]"}


def json_array_items(path: Path, max_element_chars: int, block_chars: int = JSON_BLOCK_CHARS) -> Iterator[Any]:
    """The elements of the top-level JSON array in `path`, parsed one at a time: a .json file of any size is
    read in bounded memory (an element of at most `max_element_chars` plus a block), as JSONL is, and the
    streaming driver's two passes never hold the whole dataset. Raises ValueError (json.JSONDecodeError)
    where the file stops being one valid JSON array, or at an element longer than `max_element_chars` (an
    invalid one is only known invalid once read to its end), after yielding the elements before it."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        text, position, at_end = "", 0, False

        def refill() -> bool:
            """Append a block (dropping what was parsed), at least as long as what is left unparsed, so that
            an element spanning many blocks is parsed O(log) times, not once per block; False at the end."""
            nonlocal text, position, at_end
            block = handle.read(max(block_chars, len(text) - position))
            text, position, at_end = text[position:] + block, 0, not block
            return bool(block)

        def next_character() -> str:
            """The next non-whitespace character, not consumed ('' at the end of the file)."""
            nonlocal position
            while True:
                while position < len(text) and text[position] in _WHITESPACE:
                    position += 1
                if position < len(text) or not refill():
                    return text[position] if position < len(text) else ""

        def fail(message: str) -> json.JSONDecodeError:
            return json.JSONDecodeError(message, text, position)

        if next_character() != "[":
            raise fail("expected '[' to open the array")
        position += 1
        if next_character() == "]":
            position += 1
        else:
            while True:
                while True:  # one element: parsed again with more text until a delimiter shows it complete
                    try:
                        item, end = decoder.raw_decode(text, position)
                        # "-2" of "-2.5e10" parses: an element is whole only once a delimiter follows it
                        if at_end or (end < len(text) and text[end] in _ELEMENT_ENDS):
                            break
                    except json.JSONDecodeError:
                        if at_end:
                            raise
                    if len(text) - position > max_element_chars:
                        raise fail(f"an element longer than {max_element_chars:,} characters, or invalid")
                    refill()
                position = end
                yield item
                separator = next_character()
                if separator not in (",", "]"):
                    raise fail("expected ',' or ']' after an array element")
                position += 1
                if separator == "]":
                    break
                next_character()  # raw_decode does not skip the whitespace before the next element
        if next_character() != "":
            raise fail("extra data after the array")


def _parse_error(exc: Exception) -> str:
    """A short reason for a record the JSON parser refused (hostile input must not crash the reader)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return getattr(exc, "msg", None) or str(exc)[:200]


def check_data_path(path: str) -> Path:
    """Fail at once, naming the file, if an input cannot be read at all."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--data {path}: no such file or directory")
    if p.is_file():
        if p.suffix.lower() not in (".json", ".jsonl", ".ndjson", ".parquet"):
            raise ValueError(f"--data {path}: unknown format {p.suffix!r}; use .json, .jsonl, .parquet "
                             "or a `datasets` save_to_disk directory")
        if not os.access(p, os.R_OK):
            raise ValueError(f"--data {path}: not readable")
    return p


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
