"""Evaluation prompts: MT-Bench `question.jsonl` (`turns`), JSONL with `prompt`, or with `messages`.

Each line becomes a `PromptItem`: some fixed leading messages plus one or more user turns that are asked
one after the other, each answer carried into the next turn's context (MT-Bench's second turns refer to
the first answer). The target's chat template turns a conversation into token ids.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    history: tuple[dict[str, str], ...]  # messages before the first asked turn (system prompt, earlier turns)
    turns: tuple[str, ...]               # user messages, asked in order


def _item(line: dict[str, Any], where: str) -> PromptItem:
    prompt_id = str(line.get("question_id", line.get("id", where)))
    if "turns" in line:
        turns = line["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings (MT-Bench question.jsonl)")
        return PromptItem(prompt_id, (), tuple(turns))
    if "prompt" in line:
        if not isinstance(line["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        return PromptItem(prompt_id, (), (line["prompt"],))
    if "messages" in line:
        messages = [dict(role=m["role"], content=m["content"]) for m in line["messages"]]
        while messages and messages[-1]["role"] == "assistant":  # a stored answer: we generate our own
            messages.pop()
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"{where}: 'messages' must end with a user message (after dropping trailing "
                             "assistant answers)")
        return PromptItem(prompt_id, tuple(messages[:-1]), (messages[-1]["content"],))
    raise ValueError(f"{where}: no 'turns', 'prompt' or 'messages' key; expected MT-Bench question.jsonl "
                     "lines, {\"prompt\": ...} or {\"messages\": [...]}")


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

    A tokenizer without a chat template (a base model) gets the user turns joined by blank lines.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    logger.warning("tokenizer has no chat template; using the raw turns as the prompt")
    text = "\n\n".join(m["content"] for m in messages)
    return tokenizer(text)["input_ids"]


def eos_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Every id that ends an answer: the tokenizer's EOS and the model's generation_config EOS ids."""
    ids: set[int] = set()
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    if generation_config is not None:
        candidates.append(getattr(generation_config, "eos_token_id", None))
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, (list, tuple)):
            ids.update(int(c) for c in candidate)
    return ids
