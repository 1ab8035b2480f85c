"""Extraction's records: conversations (or texts) normalised from what the shared reader yields.

The files themselves are read by `pipeline.jobkit.records` and streamed by `pipeline.jobkit.record_stream`
(shared with `regenerate`); this module says what a usable record is for extraction. Every record either
becomes a `Record` (normalised roles, a stable id) or a reject dict with a reason from `REJECT_REASONS`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from beagle.prompts import ROLE_NAMES
from pipeline.jobkit import records as _records
from pipeline.jobkit.record_stream import InputScan, RecordStream, read_records, scan_records, stream_records
from pipeline.jobkit.records import DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_TURNS

# Reasons a record can be rejected, with what they mean (the manifest counts them by these keys).
REJECT_REASONS: dict[str, str] = {
    "malformed_json": "a JSONL line that does not parse as JSON",
    "not_an_object": "a record that is not a JSON object / mapping",
    "missing_field": "none of `conversations`, `messages` or `text`, or a turn without its role/content",
    "wrong_type": "a field of the wrong type (e.g. a turn's content that is not a string)",
    "unknown_role": "a turn whose role is not user/assistant/system (e.g. tool, function)",
    "empty_conversation": "a conversation with no turns",
    "empty_text": "a `text` record whose text is empty",
    "invalid_text": "text that is not valid Unicode (e.g. a lone surrogate escape such as \\ud800)",
    "invalid_utf8": "a JSONL line whose bytes are not valid UTF-8 (never silently replaced)",
    "too_large": "a record larger than --max-record-bytes (rejected before it is parsed or tokenized)",
    "too_many_turns": "a conversation of more turns than --max-turns (rejected before it is tokenized)",
    "no_assistant_turn": "a conversation with no assistant turn after its first user turn",
    "duplicate_id": "a record whose `id` was already seen in the inputs",
    "template_error": "the chat template raised on this conversation",
    "tokenizer_error": "the tokenizer raised on this record",
    "template_not_prefix_stable": "rendering a prefix of the conversation is not a prefix of the whole",
    "no_loss_tokens": "no assistant token is left (after truncation at --max-length)",
}


class RejectRecord(_records.RejectRecord):
    """Raised while normalising or tokenizing one record; `reason` is a key of REJECT_REASONS."""

    reasons = REJECT_REASONS


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


@dataclass
class ReadResult:
    records: list[Record] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    sources: list[dict[str, Any]] = field(default_factory=list)  # {"path", "sha256", "records"}


def _content(turn: dict[str, Any], key: str) -> str:
    value = turn.get(key)
    if isinstance(value, list):  # OpenAI content parts: keep text parts, refuse anything else
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in value):
            return "".join(p["text"] for p in value)
        raise RejectRecord("wrong_type", f"`{key}` is a list with non-text parts")
    if value is None:
        raise RejectRecord("missing_field", f"a turn has no `{key}`")
    if not isinstance(value, str):
        raise RejectRecord("wrong_type", f"`{key}` is {type(value).__name__}, not a string")
    return _valid_text(value)


def _valid_text(value: str) -> str:
    """JSON admits lone surrogates (\\ud800) that no tokenizer can encode: reject them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RejectRecord("invalid_text", f"not valid Unicode at character {exc.start}") from None
    return value


def normalize_conversation(turns: Any, role_key: str, content_key: str) -> tuple[tuple[tuple[str, str], ...], int]:
    """Map roles, drop leading assistant turns and trailing non-assistant turns.

    A conversation that opens with the assistant (39% of the ShareGPT crawl: split conversations) has no
    prompt for that turn; like EAGLE we drop such leading assistant turns. Turns after the last assistant
    turn carry no loss and no later token attends to them, so they are dropped too.
    """
    if not isinstance(turns, list):
        raise RejectRecord("wrong_type", f"turns are {type(turns).__name__}, not a list")
    if not turns:
        raise RejectRecord("empty_conversation", "no turns")
    messages: list[tuple[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RejectRecord("wrong_type", f"a turn is {type(turn).__name__}, not an object")
        role = turn.get(role_key)
        if role is None:
            raise RejectRecord("missing_field", f"a turn has no `{role_key}`")
        if not isinstance(role, str):
            raise RejectRecord("wrong_type", f"`{role_key}` is {type(role).__name__}, not a string")
        if role.lower() not in ROLE_NAMES:
            raise RejectRecord("unknown_role", f"role {role!r}")
        messages.append((ROLE_NAMES[role.lower()], _content(turn, content_key)))
    systems = 0
    while systems < len(messages) and messages[systems][0] == "system":
        systems += 1
    dropped = 0
    while systems + dropped < len(messages) and messages[systems + dropped][0] == "assistant":
        dropped += 1
    kept = messages[:systems] + messages[systems + dropped:]
    last_assistant = max((i for i, (role, _) in enumerate(kept) if role == "assistant"), default=-1)
    if last_assistant < 0:
        raise RejectRecord("no_assistant_turn", "no assistant turn after the first user turn")
    return tuple(kept[:last_assistant + 1]), dropped


def normalize_record(obj: Any, *, source: str, index: int, default_id: str) -> Record:
    """Turn one raw record into a `Record` or raise `RejectRecord`."""
    if not isinstance(obj, dict):
        raise RejectRecord("not_an_object", f"record is {type(obj).__name__}")
    raw_id = obj.get("id")
    sample_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) else default_id
    if obj.get("conversations") is not None:
        messages, dropped = normalize_conversation(obj["conversations"], "from", "value")
        return Record(sample_id, source, index, messages=messages, dropped_leading_assistant=dropped)
    if obj.get("messages") is not None:
        messages, dropped = normalize_conversation(obj["messages"], "role", "content")
        return Record(sample_id, source, index, messages=messages, dropped_leading_assistant=dropped)
    if "text" in obj and obj["text"] is not None:
        if not isinstance(obj["text"], str):
            raise RejectRecord("wrong_type", f"`text` is {type(obj['text']).__name__}, not a string")
        if not obj["text"].strip():
            raise RejectRecord("empty_text", "`text` is empty")
        return Record(sample_id, source, index, text=_valid_text(obj["text"]))
    raise RejectRecord("missing_field", "no `conversations`, `messages` or `text`")


def read_inputs(paths: list[str], *, limit: int | None = None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                max_turns: int | None = DEFAULT_MAX_TURNS) -> ReadResult:
    """Read every input in order into memory; stop once `limit` usable records are collected."""
    return ReadResult(*read_records(paths, normalize_record, limit=limit, max_record_bytes=max_record_bytes,
                                    max_turns=max_turns))


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
