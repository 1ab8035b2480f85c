"""Prompts for evaluation: any input file the other commands read (MT-Bench `question.jsonl`, JSONL, a
JSON array, Parquet, a `datasets` directory), of any record shape `beagle.records` parses, made into
`PromptItem`s: fixed leading messages plus user turns asked one after the other, each answer carried into
the next turn's context (MT-Bench's second turns refer to the first answer). The target's chat template
turns a conversation into token ids (`render`).

A `{"text": ...}` record is a continuation prompt: its text is tokenized as it is (no chat template, the
tokenizer's own BOS), and the target continues it. This is how a base model, which has no chat template,
is evaluated and self-distilled.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beagle.errors import InputError
from beagle.records import (DEFAULT_MAX_RECORD_BYTES, TEXT_ROLE, RejectReason, RejectRecord, check_data_path,
                            iter_raw_records, parse_record)
from beagle.records.messages import PROMPT_SHAPES
from beagle.target_facts import token_ids

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    history: tuple[dict[str, str], ...]  # messages before the first asked turn (system prompt, earlier turns)
    turns: tuple[str, ...]               # user messages, asked in order; for a text item, its one text
    text: bool = False                   # a `{"text": ...}` continuation prompt (no chat template)
    group: str | None = None             # the record's value of the field results are grouped by (eval --by)


def group_of(obj: Any, field: str | None) -> str | None:
    """A record's value of `field` (MT-Bench's `category`, say) as a group name; None when it has none."""
    if field is None or not isinstance(obj, dict):
        return None
    value = obj.get(field)
    return None if value is None or isinstance(value, (dict, list)) else str(value)


def prompt_item(obj: Any, default_id: str) -> PromptItem:
    """An evaluation item, or `RejectRecord`: prompt-only shapes ask every turn; a stored conversation is
    kept as the history of its last user message (trailing stored answers are dropped: the target answers
    for itself). Roles outside the role map (a stored history's tool messages) go to the chat template."""
    parsed = parse_record(obj, keep_unknown_roles=True)
    prompt_id = parsed.record_id or default_id
    if parsed.shape == "text":
        return PromptItem(prompt_id, (), (parsed.messages[0]["content"],), text=True)
    if parsed.shape in PROMPT_SHAPES:
        return PromptItem(prompt_id, (), tuple(m["content"] for m in parsed.messages))
    messages = list(parsed.messages)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user":
        raise RejectRecord(RejectReason.NO_USER_TURN, "no user message at the end (after dropping trailing "
                           "assistant answers)")
    return PromptItem(prompt_id, tuple(messages[:-1]), (messages[-1]["content"],))


@dataclass
class LoadedPrompts:
    """The usable prompts of a file, and the records that were not (each `RejectRecord.as_dict`)."""

    items: list[PromptItem]
    rejects: list[dict[str, Any]]


def load_prompts(path: str | Path, limit: int | None = None, *, skip_rejects: bool = False,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, group_by: str | None = None) -> LoadedPrompts:
    """Read a prompt file of any input format; `limit` keeps the first N usable items; `group_by` names the
    record field each item's `group` is read from.

    A record that is not a usable prompt raises `InputError` naming the file, the record and the reason,
    or with `skip_rejects` is set aside in `rejects` (eval reports them and goes on with the rest)."""
    path = check_data_path(path, flag="--prompts")
    items: list[PromptItem] = []
    rejects: list[dict[str, Any]] = []
    for index, obj, unreadable, line in iter_raw_records(path, max_record_bytes=max_record_bytes, flag="--prompts"):
        where = f"{path}:{line}" if line is not None else f"{path} record {index}"
        try:
            if unreadable is not None:
                raise unreadable
            item = prompt_item(obj, f"{path.name}:{index}")
            items.append(dataclasses.replace(item, group=group_of(obj, group_by)) if group_by else item)
        except RejectRecord as reject:
            if not skip_rejects:
                raise InputError(f"--prompts {where}: {reject.reason} ({reject.detail}); expected MT-Bench "
                                 "question.jsonl lines, {\"prompt\": ...}, {\"messages\": [...]}, "
                                 "{\"conversations\": [...]} or {\"text\": ...}") from None
            rejects.append(reject.as_dict(source=str(path), index=index, **({"line": line} if line else {})))
            continue
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise InputError(f"--prompts {path}: no usable prompts" + (f" ({len(rejects)} rejected, the first: "
                         f"{rejects[0]['reason']}: {rejects[0]['detail']})" if rejects else ""))
    return LoadedPrompts(items, rejects)


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ready for the assistant's answer (chat template, generation prompt).

    A `text` message (a continuation prompt) is tokenized as it is. A tokenizer without a chat template (a
    base model) given a conversation gets the user turns joined by blank lines, with a warning.
    """
    if len(messages) == 1 and messages[0]["role"] == TEXT_ROLE:
        return tokenizer(messages[0]["content"])["input_ids"]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    logger.warning("tokenizer has no chat template; using the raw turns as the prompt")
    text = "\n\n".join(m["content"] for m in messages)
    return tokenizer(text)["input_ids"]


def eos_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Every id that ends an answer: the tokenizer's EOS and the model's generation_config EOS ids."""
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    if generation_config is not None:
        candidates.append(getattr(generation_config, "eos_token_id", None))
    return token_ids(candidates)
