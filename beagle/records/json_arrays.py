"""The elements of a top-level JSON array, one at a time, in bounded memory: `ijson` parses the bytes and
this module builds each element, with the guards a file from strangers needs.

`ijson`'s C backend (yajl) is fast but has three habits a records reader cannot accept, each guarded here:
- it replaces a lone surrogate escape (`"\\ud800"`) with `?`: silently changed text. A file with such an
  escape is parsed by ijson's pure-Python backend instead, which keeps it, so the record is rejected as
  `invalid_text` like the same line of a JSONL file (a scan for the escape costs a read at memory speed).
- it refuses integers beyond 64 bits, which JSON allows: the file is parsed again by the Python backend
  from the start, skipping the elements already given.
- its `items()` keeps a prefix string per nesting level, so a deeply nested element costs memory
  quadratic in its depth (a million `[` exhaust any machine). Elements are built here from the flat event
  stream instead; one nested deeper than `MAX_JSON_DEPTH` is read to its end but never built, and comes
  out as a `malformed_json` reject.
An element whose bytes pass `max_element_bytes` is not built further either (a `too_large` reject).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import ijson

from beagle.records.reasons import MAX_JSON_DEPTH, RejectReason, RejectRecord

logger = logging.getLogger(__name__)

SCAN_BLOCK_BYTES = 8 << 20  # bytes read at a time while looking for lone surrogate escapes
_SURROGATE_START = (b"\\ud", b"\\uD")
# A high surrogate escape not followed by a low one, or a low one not preceded by a high one.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_OVERLAP = 11  # a surrogate pair's escape is 12 bytes: a match may straddle two blocks by up to 11


@dataclass
class ArrayStats:
    """What one pass saw: elements given, and whether the array was closed or cut off at the end."""

    elements: int = 0
    closed: bool = False  # the closing `]` was read
    truncated: bool = False  # the file ended inside the array (only with allow_truncated)
    backend: str = ""


class JsonArrayError(ValueError):
    """The file is not one JSON array: what the parser said, and after how many elements."""


UTF8_BOM = b"\xef\xbb\xbf"


def has_lone_surrogate_escape(handle: BinaryIO, block_bytes: int = SCAN_BLOCK_BYTES) -> bool:
    """True if the bytes hold a `\\uD800`-`\\uDFFF` escape that is not half of a pair (an escaped backslash
    before it may make this a false alarm, which costs speed, never correctness)."""
    tail = b""
    while True:
        block = handle.read(block_bytes)
        if not block:
            return False
        window = tail + block
        if any(start in window for start in _SURROGATE_START) and _LONE_SURROGATE.search(window):
            return True
        tail = window[-_OVERLAP:]


def json_array_items(path: str | Path, *, max_element_bytes: int, allow_truncated: bool = False,
                     stats: ArrayStats | None = None,
                     reader: Callable[[BinaryIO], BinaryIO] | None = None) -> Iterator[Any]:
    """Yield each element of the JSON array in the file at `path`. An element too deep or too large comes
    as a `RejectRecord` in its place. Raises `JsonArrayError` where the bytes stop being one JSON array,
    after the elements before it; with `allow_truncated`, a file that simply ends inside the array (a cut
    download) ends the iteration with `stats.truncated` instead (a cut inside a number is not told from a
    malformed number, and raises: never is a fault taken for the end). `reader` wraps the file handle of each
    parsing pass (a progress count, or short reads in tests)."""
    stats = stats if stats is not None else ArrayStats()
    with open(path, "rb") as handle:
        # A cut is told from a fault by the Python backend alone (yajl's words for a file cut inside an
        # escape are those of a bad escape), so a file that may be cut is parsed by it.
        backend = "python" if allow_truncated or has_lone_surrogate_escape(handle) else "yajl2_c"
    try:
        yield from _parse(path, reader, backend, max_element_bytes, allow_truncated, stats, skip=0)
    except _NeedsPythonBackend:
        logger.info("%s: an integer beyond 64 bits: parsing again with ijson's Python backend", path)
        yield from _parse(path, reader, "python", max_element_bytes, allow_truncated, stats, skip=stats.elements)


class _NeedsPythonBackend(Exception):
    """yajl refused something JSON allows (an integer beyond 64 bits)."""


class _CountingReader:
    """A binary file that counts the bytes handed to the parser (how large the element being built is);
    both ijson backends only call `read`."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.consumed = handle, 0

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.consumed += len(data)
        return data


def _parse(path: str | Path, wrap: Callable[[BinaryIO], BinaryIO] | None, backend: str, max_element_bytes: int,
           allow_truncated: bool, stats: ArrayStats, skip: int) -> Iterator[Any]:
    """One pass of the parser; the first `skip` elements are parsed but not given again."""
    events_of = ijson.get_backend(backend).basic_parse
    stats.backend = backend
    index, opened = 0, False
    with open(path, "rb") as raw:
        if raw.read(len(UTF8_BOM)) != UTF8_BOM:  # a BOM (Windows editors write one) is not JSON: skipped
            raw.seek(0)
        reader = _CountingReader(wrap(raw) if wrap is not None else raw)
        events = events_of(reader, use_float=True)
        try:
            first = next(events, None)
            if first is None or first[0] != "start_array":
                raise JsonArrayError("expected a JSON array opening with '['")
            opened = True
            for event, value in events:
                if event == "end_array":  # the top-level array's `]`: elements consume their own ends
                    stats.closed = True
                    break
                element = _element(event, value, events, reader, max_element_bytes)
                if index >= skip:
                    stats.elements += 1
                    yield element
                index += 1
            for _ in events:  # nothing may follow the array (the parser raises on trailing bytes)
                raise JsonArrayError("extra data after the array")
        except ijson.JSONError as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "integer overflow" in message and backend != "python":
                raise _NeedsPythonBackend() from None
            if not opened:
                raise JsonArrayError("expected a JSON array opening with '['") from None
            if allow_truncated and not stats.closed and isinstance(exc, ijson.IncompleteJSONError):
                stats.truncated = True
                return
            raise JsonArrayError(f"{message.strip(chr(39) + 'b')} (after element {index})") from None


def _element(event: str, value: Any, events: Iterator[tuple[str, Any]], reader: _CountingReader,
             max_element_bytes: int) -> Any:
    """Build one element from its first event and those after it, or a RejectRecord if it is too deep or
    too large (its remaining events are then read and dropped)."""
    if event not in ("start_map", "start_array"):
        return value  # a scalar element is one event
    builder = ijson.ObjectBuilder()
    builder.event(event, value)
    depth, start, reject = 1, reader.consumed, None
    for event, value in events:
        if event in ("start_map", "start_array"):
            depth += 1
            if depth > MAX_JSON_DEPTH and reject is None:
                reject = RejectRecord(RejectReason.MALFORMED_JSON, f"nested more than {MAX_JSON_DEPTH} levels deep")
        elif event in ("end_map", "end_array"):
            depth -= 1
        if reject is None and reader.consumed - start > max_element_bytes:
            reject = RejectRecord(RejectReason.TOO_LARGE, f"an array element of more than {max_element_bytes:,} bytes")
        if reject is None:
            builder.event(event, value)
        else:
            builder = None  # free what was built
        if depth == 0:
            return reject if reject is not None else builder.value
    raise ijson.IncompleteJSONError("Incomplete JSON content")
