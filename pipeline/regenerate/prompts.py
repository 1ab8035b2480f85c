"""Prompt records for regeneration: the user turns of a conversation, with its leading system prompt.

Accepts what `extract` accepts (`conversations` / `messages`; their assistant turns are discarded, since
the target writes its own) plus prompt-only data: MT-Bench `turns` and `{"prompt": ...}`. A `{"text": ...}`
record is continued as it is (no chat template): how a base model answers. A record that
cannot be used becomes a reject dict naming its file, record and reason, like extraction's. Records are
read and parsed by `beagle.records`, as extraction's and evaluation's are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beagle.records import DEFAULT_MAX_RECORD_BYTES, TEXT_ROLE, RejectReason, RejectRecord, parse_record
from pipeline.jobkit.record_stream import InputScan, RecordStream, scan_records, stream_records


@dataclass(frozen=True)
class PromptRecord:
    """The prompts of one conversation, asked in order; each answer is carried into the next turn."""

    sample_id: str
    source: str
    index: int                # 0-based record position in its file
    system: tuple[str, ...]   # leading system messages
    turns: tuple[str, ...]    # user messages; for a text record, its one text
    line: int | None = None   # JSONL line number
    text: bool = False        # a `{"text": ...}` record: continued without a chat template


def normalize_prompt_record(obj: Any, *, source: str, index: int, default_id: str) -> PromptRecord:
    """One raw record -> `PromptRecord` (system prompt and non-blank user turns), or `RejectRecord`.

    Stored assistant turns are dropped unread, and so are system messages after the first user turn.
    """
    parsed = parse_record(obj, check_answers=False)
    if parsed.messages[0]["role"] == TEXT_ROLE:
        return PromptRecord(parsed.record_id or default_id, source, index, (), (parsed.messages[0]["content"],),
                            text=True)
    first_user = next((k for k, m in enumerate(parsed.messages) if m["role"] == "user"), len(parsed.messages))
    system = tuple(m["content"] for m in parsed.messages[:first_user] if m["role"] == "system")
    turns = tuple(m["content"] for m in parsed.messages if m["role"] == "user" and m["content"].strip())
    if not turns:
        raise RejectRecord(RejectReason.NO_USER_TURN, "no non-empty user turn")
    return PromptRecord(parsed.record_id or default_id, source, index, system, turns)


def _is_conversation(record: PromptRecord) -> bool:
    return not record.text


def scan_prompts(paths: list[str], *, limit: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> InputScan:
    """One pass over the inputs keeping counts only: what the output's identity needs, and where the first
    conversation is (it needs a chat template). `limit`: the first `limit` usable records."""
    return scan_records(paths, normalize_prompt_record, is_conversation=_is_conversation, limit=limit,
                        max_record_bytes=max_record_bytes)


def stream_prompts(paths: list[str], scan: InputScan, *, limit: int | None = None,
                   max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> RecordStream:
    """The `PromptRecord`s `scan` counted, read again lazily, in input order."""
    return stream_records(paths, normalize_prompt_record, scan, limit=limit, max_record_bytes=max_record_bytes)
