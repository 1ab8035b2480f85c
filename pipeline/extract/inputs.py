"""Extraction's records: conversations (or texts) with answers to learn from, normalised from what the one
records reader yields.

The files are read by `beagle.records` (every format, one parser, one `RejectReason` enum) and streamed by
`pipeline.jobkit.record_stream` (shared with `regenerate`); this module says what a usable record is for
extraction: every record either becomes a `Record` (normalised roles, a stable id) or a reject.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beagle.records import (DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_TURNS, TEXT_ROLE, RejectReason, RejectRecord,
                            parse_record)
from beagle.records.messages import PROMPT_SHAPES
from pipeline.jobkit.record_stream import InputScan, RecordStream, scan_records, stream_records


@dataclass(frozen=True)
class Record:
    """One usable input record. `messages` is set for chats, `text` for plain text records."""

    sample_id: str
    source: str  # the input path as given
    index: int  # 0-based record position in its file (JSONL: line number - 1)
    messages: tuple[tuple[str, str], ...] | None = None  # ((role, content), ...)
    text: str | None = None
    dropped_leading_assistant: int = 0
    line: int | None = None  # JSONL line number, for rejects found after reading


def trim_conversation(messages: list[tuple[str, str]]) -> tuple[tuple[tuple[str, str], ...], int]:
    """Drop leading assistant turns and trailing non-assistant turns; (kept turns, leading turns dropped).

    A conversation that opens with the assistant (39% of the ShareGPT crawl: split conversations) has no
    prompt for that turn; like EAGLE we drop such leading assistant turns. Turns after the last assistant
    turn carry no loss and no later token attends to them, so they are dropped too.
    """
    systems = 0
    while systems < len(messages) and messages[systems][0] == "system":
        systems += 1
    dropped = 0
    while systems + dropped < len(messages) and messages[systems + dropped][0] == "assistant":
        dropped += 1
    kept = messages[:systems] + messages[systems + dropped:]
    last_assistant = max((i for i, (role, _) in enumerate(kept) if role == "assistant"), default=-1)
    if last_assistant < 0:
        raise RejectRecord(RejectReason.NO_ASSISTANT_TURN, "no assistant turn after the first user turn")
    return tuple(kept[:last_assistant + 1]), dropped


def normalize_record(obj: Any, *, source: str, index: int, default_id: str) -> Record:
    """Turn one raw record into a `Record` or raise `RejectRecord`."""
    parsed = parse_record(obj)
    sample_id = parsed.record_id or default_id
    if parsed.shape in PROMPT_SHAPES:
        raise RejectRecord(RejectReason.MISSING_FIELD, f"a prompt-only record (`{parsed.shape}`) has no answers "
                           "to learn from; answer it with `beagle-pipeline regenerate` first")
    if parsed.messages[0]["role"] == TEXT_ROLE:
        return Record(sample_id, source, index, text=parsed.messages[0]["content"])
    messages, dropped = trim_conversation([(m["role"], m["content"]) for m in parsed.messages])
    return Record(sample_id, source, index, messages=messages, dropped_leading_assistant=dropped)


def _is_conversation(record: Record) -> bool:
    return record.messages is not None


def scan_inputs(paths: list[str], *, limit: int | None = None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                max_turns: int | None = DEFAULT_MAX_TURNS) -> InputScan:
    """Read the inputs once, keeping only counts. Extraction must know the dataset_id (which counts each
    file's records up to `limit`) before it claims a store, and must not hold the records to know it."""
    return scan_records(paths, normalize_record, is_conversation=_is_conversation, limit=limit,
                        max_record_bytes=max_record_bytes, max_turns=max_turns)


def stream_inputs(paths: list[str], scan: InputScan, *, limit: int | None = None,
                  max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                  max_turns: int | None = DEFAULT_MAX_TURNS) -> RecordStream:
    """The records `scan` counted, read again lazily (the files are not hashed a second time)."""
    return stream_records(paths, normalize_record, scan, limit=limit, max_record_bytes=max_record_bytes,
                          max_turns=max_turns)
