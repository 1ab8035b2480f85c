"""Prompt records for regeneration: the user turns of a conversation, with its leading system prompt.

Accepts what `extract` accepts (`conversations` / `messages`; their assistant turns are discarded, since
the target writes its own) plus prompt-only data: MT-Bench `turns` and `{"prompt": ...}`. A record that
cannot be used becomes a reject dict naming its file, record and reason, like extraction's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.extract.inputs import ROLE_NAMES, RejectRecord, read_records

# Reasons a record can be rejected by regeneration (written to the rejects file by these keys).
REGENERATE_REJECT_REASONS: dict[str, str] = {
    "malformed_json": "a JSONL line that does not parse as JSON",
    "not_an_object": "a record that is not a JSON object / mapping",
    "missing_field": "none of `conversations`, `messages`, `turns` or `prompt`, or a turn without role/content",
    "wrong_type": "a field of the wrong type (e.g. a turn's content that is not a string)",
    "unknown_role": "a turn whose role is not user/assistant/system (e.g. tool, function)",
    "invalid_text": "text that is not valid Unicode (e.g. a lone surrogate escape such as \\ud800)",
    "no_user_turn": "a record without a non-empty user turn to answer",
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
    turns: tuple[str, ...]    # user messages
    line: int | None = None   # JSONL line number


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise RejectPrompt("wrong_type", f"{what} is {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RejectPrompt("invalid_text", f"{what}: not valid Unicode at character {error.start}") from None
    return value


def _from_turns(turns: Any, role_key: str, content_key: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(system, user turns) of a chat; assistant turns are dropped, the target answers for itself."""
    if not isinstance(turns, list):
        raise RejectPrompt("wrong_type", f"turns are {type(turns).__name__}, not a list")
    system: list[str] = []
    users: list[str] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RejectPrompt("wrong_type", f"a turn is {type(turn).__name__}, not an object")
        role, content = turn.get(role_key), turn.get(content_key)
        if role is None or content is None:
            raise RejectPrompt("missing_field", f"a turn has no `{role_key}` or `{content_key}`")
        role = ROLE_NAMES.get(_text(role, f"`{role_key}`").lower())
        if role is None:
            raise RejectPrompt("unknown_role", f"role {turn.get(role_key)!r}")
        if role == "system" and not users:
            system.append(_text(content, "a system message"))
        elif role == "user":
            users.append(_text(content, "a user message"))
    return tuple(system), tuple(users)


def normalize_prompt_record(obj: Any, *, source: str, index: int, default_id: str) -> PromptRecord:
    """One raw record -> `PromptRecord`, or `RejectPrompt`."""
    if not isinstance(obj, dict):
        raise RejectPrompt("not_an_object", f"record is {type(obj).__name__}")
    raw_id = obj.get("id", obj.get("question_id"))
    sample_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) else default_id
    system: tuple[str, ...] = ()
    if obj.get("conversations") is not None:
        system, turns = _from_turns(obj["conversations"], "from", "value")
    elif obj.get("messages") is not None:
        system, turns = _from_turns(obj["messages"], "role", "content")
    elif obj.get("turns") is not None:
        if not isinstance(obj["turns"], list):
            raise RejectPrompt("wrong_type", "`turns` is not a list of strings")
        turns = tuple(_text(t, "a turn") for t in obj["turns"])
    elif obj.get("prompt") is not None:
        turns = (_text(obj["prompt"], "`prompt`"),)
    else:
        raise RejectPrompt("missing_field", "no `conversations`, `messages`, `turns` or `prompt`")
    turns = tuple(t for t in turns if t.strip())
    if not turns:
        raise RejectPrompt("no_user_turn", "no non-empty user turn")
    return PromptRecord(sample_id, source, index, system, turns)


@dataclass
class PromptRead:
    records: list[PromptRecord]
    rejects: list[dict[str, Any]]
    sources: list[dict[str, Any]]  # {"path", "sha256", "records"}


def read_prompts(paths: list[str], *, limit: int | None = None) -> PromptRead:
    """Read every input in order (as extraction does), stopping once `limit` usable records are collected."""
    return PromptRead(*read_records(paths, normalize_prompt_record, limit=limit))
