"""Prompt records for regeneration: the user turns of a conversation, with its leading system prompt.

Accepts what `extract` accepts (`conversations` / `messages`; their assistant turns are discarded, since
the target writes its own) plus prompt-only data: MT-Bench `turns` and `{"prompt": ...}`. A `{"text": ...}`
record is continued as it is (no chat template): how a base model answers. A record that
cannot be used becomes a reject dict naming its file, record and reason, like extraction's. Records are
parsed by `beagle.prompts.parse_prompt_record`, the parser evaluation reads its prompt files with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beagle.prompts import PROMPT_REJECT_REASONS, PromptRecordError, parse_prompt_record
from pipeline.jobkit.record_stream import InputScan, RecordStream, scan_records, stream_records
from pipeline.jobkit.records import DEFAULT_MAX_RECORD_BYTES, RejectRecord

# Reasons a record can be rejected by regeneration (written to the rejects file by these keys).
REGENERATE_REJECT_REASONS: dict[str, str] = {
    "malformed_json": "a JSONL line that does not parse as JSON",
    **PROMPT_REJECT_REASONS,
    "duplicate_id": "a record whose `id` was already seen in the inputs",
    "prompt_too_long": "the first turn's prompt is longer than --max-prompt-length tokens",
}


class RejectPrompt(RejectRecord):
    """One record that cannot be regenerated; `reason` is a key of REGENERATE_REJECT_REASONS."""

    reasons = REGENERATE_REJECT_REASONS


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
    """One raw record -> `PromptRecord` (system prompt and non-blank user turns), or `RejectPrompt`.

    Stored assistant turns are dropped, and so are system messages after the first user turn.
    """
    try:
        parsed = parse_prompt_record(obj)
    except PromptRecordError as error:
        raise RejectPrompt(error.reason, error.detail) from None
    if parsed.shape == "text":
        return PromptRecord(parsed.prompt_id or default_id, source, index, (), (parsed.messages[0]["content"],),
                            text=True)
    first_user = next((k for k, m in enumerate(parsed.messages) if m["role"] == "user"), len(parsed.messages))
    system = tuple(m["content"] for m in parsed.messages[:first_user] if m["role"] == "system")
    turns = tuple(m["content"] for m in parsed.messages if m["role"] == "user" and m["content"].strip())
    if not turns:
        raise RejectPrompt("no_user_turn", "no non-empty user turn")
    return PromptRecord(parsed.prompt_id or default_id, source, index, system, turns)


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
