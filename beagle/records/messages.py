"""What a record says: its id, its shape and its messages, parsed one way for every command.

A record is a chat (`conversations` in ShareGPT's from/value form, or `messages` in OpenAI's role/content
form, content parts of type text included), prompt-only data (MT-Bench `turns`, `{"prompt": ...}`), or a
`{"text": ...}` record for a base model. `parse_record` checks one and returns its messages with roles
mapped through `ROLE_NAMES`; each command then decides what it needs: extraction the answers, regeneration
the user turns, evaluation the history and the turns to ask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from beagle.records.reasons import RejectReason, RejectRecord

# Role names seen in ShareGPT-style crawls and chat APIs, mapped to chat-template roles.
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
              "system": "system", "developer": "system"}
SHAPES = ("conversations", "messages", "turns", "prompt", "text")  # looked for in this order
CHAT_SHAPES = {"conversations": ("from", "value"), "messages": ("role", "content")}
PROMPT_SHAPES = ("turns", "prompt")  # prompts without answers
TEXT_ROLE = "text"  # the one message of a `{"text": ...}` record: continued as it is, without a chat template


@dataclass(frozen=True)
class ParsedRecord:
    """One record: its id (None when it has none usable), the key its messages came from, and the
    messages in order as {"role", "content"} dicts (a text record: one message of role TEXT_ROLE)."""

    record_id: str | None
    shape: str
    messages: tuple[dict[str, Any], ...]


def parse_record(obj: Any, *, keep_unknown_roles: bool = False, check_answers: bool = True) -> ParsedRecord:
    """Check one raw record and return its messages, or raise `RejectRecord`.

    `keep_unknown_roles`: pass a role outside ROLE_NAMES on as written (evaluation hands a stored history's
    tool messages to the chat template) instead of rejecting the record. `check_answers=False`: keep
    assistant contents as stored, unchecked (regeneration discards them: a bad stored answer is no reason
    to lose the prompt).
    """
    if not isinstance(obj, dict):
        raise RejectRecord(RejectReason.NOT_AN_OBJECT, f"record is {type(obj).__name__}")
    raw_id = obj.get("id", obj.get("question_id"))
    record_id = str(raw_id) if isinstance(raw_id, (str, int)) and str(raw_id) else None
    shape = next((key for key in SHAPES if obj.get(key) is not None), None)
    if shape is None:
        raise RejectRecord(RejectReason.MISSING_FIELD, "no `conversations`, `messages`, `turns`, `prompt` or "
                           "`text`: expected ShareGPT or OpenAI chats, MT-Bench questions, prompts or texts")
    value = obj[shape]
    if shape in CHAT_SHAPES:
        messages = _chat_messages(value, *CHAT_SHAPES[shape], keep_unknown_roles, check_answers)
    elif shape == "turns":
        if not isinstance(value, list):
            raise RejectRecord(RejectReason.WRONG_TYPE, f"`turns` is {type(value).__name__}, not a list of strings")
        if not value:
            raise RejectRecord(RejectReason.EMPTY_CONVERSATION, "`turns` is empty")
        messages = tuple({"role": "user", "content": text_value(turn, "a turn")} for turn in value)
    elif shape == "prompt":
        messages = ({"role": "user", "content": text_value(value, "`prompt`")},)
    else:
        text = text_value(value, "`text`")
        if not text.strip():
            raise RejectRecord(RejectReason.EMPTY_TEXT, "`text` is empty")
        messages = ({"role": TEXT_ROLE, "content": text},)
    return ParsedRecord(record_id, shape, messages)


def text_value(value: Any, what: str) -> str:
    """`value` if it is a string that encodes as UTF-8 (JSON admits lone surrogates such as \\ud800, which no
    tokenizer can encode), else `RejectRecord` naming `what`."""
    if not isinstance(value, str):
        raise RejectRecord(RejectReason.WRONG_TYPE, f"{what} is {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RejectRecord(RejectReason.INVALID_TEXT, f"{what}: not valid Unicode at character {error.start}") from None
    return value


def content_text(value: Any, what: str) -> str:
    """A message's content: a string, or OpenAI content parts that are all text (joined); anything else
    (an image part, a number) is refused."""
    if isinstance(value, list):
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            return text_value("".join(p["text"] for p in value), what)
        raise RejectRecord(RejectReason.WRONG_TYPE, f"{what} is a list with non-text parts")
    return text_value(value, what)


def _chat_messages(turns: Any, role_key: str, content_key: str, keep_unknown_roles: bool,
                   check_answers: bool) -> tuple[dict[str, Any], ...]:
    if not isinstance(turns, list):
        raise RejectRecord(RejectReason.WRONG_TYPE, f"turns are {type(turns).__name__}, not a list")
    if not turns:
        raise RejectRecord(RejectReason.EMPTY_CONVERSATION, "no turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RejectRecord(RejectReason.WRONG_TYPE, f"a turn is {type(turn).__name__}, not an object")
        role, content = turn.get(role_key), turn.get(content_key)
        if role is None:
            raise RejectRecord(RejectReason.MISSING_FIELD, f"a turn has no `{role_key}`")
        role = text_value(role, f"`{role_key}`")
        if role.lower() in ROLE_NAMES:
            role = ROLE_NAMES[role.lower()]
        elif not keep_unknown_roles:
            raise RejectRecord(RejectReason.UNKNOWN_ROLE, f"role {role!r}")
        if content is None:
            raise RejectRecord(RejectReason.MISSING_FIELD, f"a turn has no `{content_key}`")
        if role != "assistant" or check_answers:
            content = content_text(content, f"a {role} message's `{content_key}`")
        messages.append({"role": role, "content": content})
    return tuple(messages)
