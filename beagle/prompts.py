"""Prompt files: MT-Bench `question.jsonl` (`turns`), `{"prompt": ...}`, `messages` or ShareGPT
`conversations`, and `{"text": ...}` for base models, parsed by one function for evaluation and for
regeneration.

`parse_prompt_record` checks one record's shape and text and returns its messages; each user of it
decides what to ask. Evaluation (`load_prompts`) makes a `PromptItem`: fixed leading messages plus user
turns asked one after the other, each answer carried into the next turn's context (MT-Bench's second
turns refer to the first answer). Regeneration (`pipeline.regenerate.prompts`) keeps the system prompt
and every user turn. The target's chat template turns a conversation into token ids.

A `{"text": ...}` record is a continuation prompt: its text is tokenized as it is (no chat template, the
tokenizer's own BOS), and the target continues it. This is how a base model, which has no chat template,
is evaluated and self-distilled.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beagle.target_facts import token_ids

logger = logging.getLogger(__name__)

# Why a prompt record can be unusable (regeneration writes these keys to its rejects file).
PROMPT_REJECT_REASONS: dict[str, str] = {
    "not_an_object": "a record that is not a JSON object / mapping",
    "missing_field": "none of `conversations`, `messages`, `turns`, `prompt` or `text`, or a turn without "
                     "role/content",
    "wrong_type": "a field of the wrong type (e.g. a turn's content that is not a string)",
    "unknown_role": "a turn whose role is not user/assistant/system (e.g. tool, function)",
    "invalid_text": "text that is not valid Unicode (e.g. a lone surrogate escape such as \\ud800)",
    "no_user_turn": "a record without a non-empty user turn to answer (or an empty `text`)",
}
# Role names seen in ShareGPT-style crawls, mapped to chat-template roles (extraction reads chats with it too).
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
              "system": "system", "developer": "system"}
_SHAPES = ("conversations", "messages", "turns", "prompt", "text")  # looked for in this order
TEXT_ROLE = "text"  # the one message of a `{"text": ...}` record: continued as it is, without a chat template
_CHAT_KEYS = {"conversations": ("from", "value"), "messages": ("role", "content")}


class PromptRecordError(ValueError):
    """One record that cannot be used as a prompt; `reason` is a key of PROMPT_REJECT_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class ParsedPrompt:
    """One prompt record: its id (None when it has no usable one), its shape and its messages in order.

    `shape` is the key the messages came from; user and system contents are checked strings, assistant
    contents are kept as stored (regeneration discards them, evaluation checks the ones it keeps).
    """

    prompt_id: str | None
    shape: str
    messages: tuple[dict[str, Any], ...]


def parse_prompt_record(obj: Any, *, keep_unknown_roles: bool = False) -> ParsedPrompt:
    """Check one prompt record and return its messages, or raise `PromptRecordError`.

    Roles are mapped through ROLE_NAMES (ShareGPT's human/gpt become user/assistant). Any other role is
    refused, or with `keep_unknown_roles` passed on as written (evaluation hands tool messages of a
    stored history to the chat template).
    """
    if not isinstance(obj, dict):
        raise PromptRecordError("not_an_object", f"record is {type(obj).__name__}")
    raw_id = obj.get("id", obj.get("question_id"))
    prompt_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) else None
    shape = next((key for key in _SHAPES if obj.get(key) is not None), None)
    if shape is None:
        raise PromptRecordError("missing_field", "no 'turns', 'prompt', 'messages', 'conversations' or 'text' key; "
                                "expected MT-Bench question.jsonl lines, {\"prompt\": ...}, "
                                "{\"messages\": [...]}, {\"conversations\": [...]} or {\"text\": ...}")
    if shape in _CHAT_KEYS:
        messages = _chat_messages(obj[shape], *_CHAT_KEYS[shape], keep_unknown_roles)
    elif shape == "turns":
        if not isinstance(obj["turns"], list):
            raise PromptRecordError("wrong_type", "`turns` is not a list of strings")
        messages = tuple({"role": "user", "content": prompt_text(t, "a turn")} for t in obj["turns"])
    elif shape == "text":
        text = prompt_text(obj["text"], "`text`")
        if not text.strip():
            raise PromptRecordError("no_user_turn", "`text` is empty")
        messages = ({"role": TEXT_ROLE, "content": text},)
    else:
        messages = ({"role": "user", "content": prompt_text(obj["prompt"], "`prompt`")},)
    return ParsedPrompt(prompt_id, shape, messages)


def prompt_text(value: Any, what: str) -> str:
    """`value` if it is a string that encodes as UTF-8, else `PromptRecordError` naming `what`."""
    if not isinstance(value, str):
        raise PromptRecordError("wrong_type", f"{what} is {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PromptRecordError("invalid_text", f"{what}: not valid Unicode at character {error.start}") from None
    return value


def _chat_messages(turns: Any, role_key: str, content_key: str,
                   keep_unknown_roles: bool) -> tuple[dict[str, Any], ...]:
    if not isinstance(turns, list):
        raise PromptRecordError("wrong_type", f"turns are {type(turns).__name__}, not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise PromptRecordError("wrong_type", f"a turn is {type(turn).__name__}, not an object")
        role, content = turn.get(role_key), turn.get(content_key)
        if role is None or content is None:
            raise PromptRecordError("missing_field", f"a turn has no `{role_key}` or `{content_key}`")
        role = prompt_text(role, f"`{role_key}`")
        if role.lower() in ROLE_NAMES:
            role = ROLE_NAMES[role.lower()]
        elif not keep_unknown_roles:
            raise PromptRecordError("unknown_role", f"role {role!r}")
        if role != "assistant":
            content = prompt_text(content, f"a {role} message")
        messages.append({"role": role, "content": content})
    return tuple(messages)


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    history: tuple[dict[str, str], ...]  # messages before the first asked turn (system prompt, earlier turns)
    turns: tuple[str, ...]               # user messages, asked in order; for a text item, its one text
    text: bool = False                   # a `{"text": ...}` continuation prompt (no chat template)


def _item(line: Any, where: str) -> PromptItem:
    """An evaluation item: prompt-only shapes ask every turn; a stored conversation is kept as the history
    of its last user message (trailing stored answers are dropped: the target answers for itself)."""
    try:
        parsed = parse_prompt_record(line, keep_unknown_roles=True)
        prompt_id = parsed.prompt_id or where
        if parsed.shape == "text":
            return PromptItem(prompt_id, (), (parsed.messages[0]["content"],), text=True)
        if parsed.shape in ("turns", "prompt"):
            if not parsed.messages:
                raise ValueError("'turns' must be a non-empty list of strings (MT-Bench question.jsonl)")
            return PromptItem(prompt_id, (), tuple(m["content"] for m in parsed.messages))
        messages = list(parsed.messages)
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages or messages[-1]["role"] != "user":
            raise ValueError("'messages' must end with a user message (after dropping trailing assistant answers)")
        history = tuple(dict(m, content=prompt_text(m["content"], f"a {m['role']} message")) for m in messages[:-1])
        return PromptItem(prompt_id, history, (messages[-1]["content"],))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def load_prompts(path: str | Path, limit: int | None = None) -> list[PromptItem]:
    """Read a JSONL prompt file; `limit` keeps the first N items."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found; pass --prompts question.jsonl or a JSONL file")
    items: list[PromptItem] = []
    with path.open(encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg}); one JSON object per line") from None
            items.append(_item(line, where))
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise ValueError(f"prompt file {path} has no prompts")
    return items


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
