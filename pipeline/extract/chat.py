"""Tokenize records with the target's own chat template and mark the tokens the model generates.

loss_mask is 1 exactly on the tokens of assistant turns: the turn's content and its end-of-turn marker
(e.g. `<|im_end|>`), not the role header the template writes before it and not the whitespace the
template writes after it. Two ways to find them, both exact:
  * the template has `{% generation %}` markers: transformers' `return_assistant_tokens_mask`;
  * it has none: render growing prefixes. For assistant turn i, P = render(turns[:i], generation
    prompt) and Q = render(turns[:i+1]); the turn is the text Q[len(P):], minus the template's trailing
    whitespace. Both must be prefixes of the full rendering, otherwise the template rewrites history
    (e.g. strips earlier reasoning) and the record is rejected as `template_not_prefix_stable`.
Tokens overlapping an assistant character span are marked, as transformers does for generation markers,
so the two paths agree on the same template (tested).
"""
from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from beagle.records import RejectReason, RejectRecord
from pipeline.extract.inputs import Record

logger = logging.getLogger(__name__)

_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class Tokenized:
    input_ids: np.ndarray  # [L] int32
    loss_mask: np.ndarray  # [L] bool
    truncated: bool


def has_generation_markers(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_MARKER.search(template))


def tokenizer_fingerprint(model_path: str, tokenizer: Any) -> dict[str, str]:
    """Hashes of the tokenizer files and of the chat template: both decide the stored ids and masks."""
    digest = hashlib.sha256()
    for name in sorted(p.name for p in Path(model_path).iterdir() if p.is_file()):
        if name.startswith(("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges",
                            "chat_template")):
            digest.update(name.encode() + b"\0" + (Path(model_path) / name).read_bytes())
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return {"files_sha256": digest.hexdigest(),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()}


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _assistant_spans(tokenizer: Any, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full` (the rendered conversation), end markers included.

    Rendering growing prefixes of the conversation finds them for any prefix-stable template, but costs
    the square of the conversation's length; the skeleton path gets the same spans in linear time and is
    used whenever it can prove itself exact (see `_spans_from_skeleton`)."""
    spans = _spans_from_skeleton(tokenizer, messages, full)
    return spans if spans is not None else _spans_from_prefixes(tokenizer, messages, full)


def _turn_span(start: int, turn: str, content: str) -> tuple[int, int]:
    """The span of one assistant turn rendered as `turn` from `start`: its content and end-of-turn
    marker, without the whitespace the template adds after them."""
    at = turn.rfind(content) if content else -1
    content_end = at + len(content) if at >= 0 else 0
    return start, start + content_end + len(turn[content_end:].rstrip())


def _spans_from_prefixes(tokenizer: Any, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]]:
    """Render turns[:i] (with the generation prompt) and turns[:i+1] for every assistant turn i."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[:i + 1], generation_prompt=False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise RejectRecord(RejectReason.TEMPLATE_NOT_PREFIX_STABLE,
                               f"rendering turns[:{i + 1}] is not a prefix of the full conversation")
        spans.append(_turn_span(len(prefix), upto[len(prefix):], message["content"]))
    return spans


_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"  # private-use characters: no template treats them specially


def _spans_from_skeleton(tokenizer: Any, messages: list[dict[str, str]],
                         full: str) -> list[tuple[int, int]] | None:
    """The prefix renders done on a skeleton whose contents are short marks, so that each costs the
    template's markup only, then mapped to positions in `full`.

    Exact when the template inserts every content verbatim, which is checked: the skeleton with each mark
    replaced by its content must be `full` itself. None (use the prefix renders) when it is not, e.g. a
    template that trims contents, or contents holding the mark characters."""
    if any(_MARK_OPEN in m["content"] or _MARK_CLOSE in m["content"] for m in messages):
        return None
    marks = [f"{_MARK_OPEN}{i}{_MARK_CLOSE}" for i in range(len(messages))]
    skeleton = [{**message, "content": mark} for message, mark in zip(messages, marks)]
    skeleton_full = _render(tokenizer, skeleton, generation_prompt=False)
    mark_ends, pieces, cursor = [], [], 0  # mark_ends[k]: (end of mark k in the skeleton, shift after it)
    shift = 0
    for mark, message in zip(marks, messages):
        at = skeleton_full.find(mark, cursor)
        if at < 0 or skeleton_full.count(mark) != 1:
            return None
        pieces += [skeleton_full[cursor:at], message["content"]]
        cursor = at + len(mark)
        shift += len(message["content"]) - len(mark)
        mark_ends.append((at, cursor, shift))
    pieces.append(skeleton_full[cursor:])
    if "".join(pieces) != full:
        return None

    def real(position: int) -> int | None:
        """Position in `full` of a skeleton position that falls outside every mark."""
        moved = 0
        for start, end, shift_after in mark_ends:
            if position >= end:
                moved = shift_after
            elif position > start:
                return None
        return position + moved

    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, skeleton[:i], generation_prompt=True)
        upto = _render(tokenizer, skeleton[:i + 1], generation_prompt=False)
        start, end = real(len(prefix)), real(len(upto))
        if not (upto.startswith(prefix) and skeleton_full.startswith(upto)) or start is None or end is None:
            return None  # let the prefix renders decide (and reject if the template truly is unstable)
        spans.append(_turn_span(start, full[start:end], message["content"]))
    return spans


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """True for every token whose characters overlap a span; vectorised over tokens."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] character start, end
    mask = np.zeros(len(bounds), dtype=bool)
    for start, end in spans:
        mask |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
    return mask


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], np.ndarray]:
    """(input_ids, loss_mask) of a whole conversation, before truncation."""
    try:
        if has_generation_markers(tokenizer):
            encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                    return_assistant_tokens_mask=True)
            return list(encoded["input_ids"]), np.asarray(encoded["assistant_masks"], dtype=bool)
        full = _render(tokenizer, messages, generation_prompt=False)
        spans = _assistant_spans(tokenizer, messages, full)
    except RejectRecord:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError and friends
        raise RejectRecord(RejectReason.TEMPLATE_ERROR, str(exc).strip().splitlines()[0][:200] if str(exc) else
                           type(exc).__name__) from None
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), _mask_from_spans(encoded["offset_mapping"], spans)


def tokenize_text(tokenizer: Any, text: str) -> tuple[list[int], np.ndarray]:
    """Plain text: every token is generated text, so every token but the tokenizer's specials counts."""
    encoded = tokenizer(text, add_special_tokens=True, return_special_tokens_mask=True)
    return list(encoded["input_ids"]), ~np.asarray(encoded["special_tokens_mask"], dtype=bool)


def tokenize_record(tokenizer: Any, record: Record, *, max_length: int) -> Tokenized:
    """Tokenize one record and truncate it at `max_length`; `RejectRecord` when nothing is left to learn."""
    if record.messages is not None:
        if not isinstance(tokenizer.chat_template, str):
            raise RejectRecord(RejectReason.TEMPLATE_ERROR, "the tokenizer has no chat template")
        messages = [{"role": role, "content": content} for role, content in record.messages]
        ids, mask = tokenize_chat(tokenizer, messages)
    else:
        ids, mask = tokenize_text(tokenizer, record.text or "")
    truncated = len(ids) > max_length
    input_ids = np.asarray(ids[:max_length], dtype=np.int32)
    loss_mask = mask[:max_length]
    if not loss_mask.any():
        raise RejectRecord(RejectReason.NO_LOSS_TOKENS, f"{len(ids)} tokens, none of them assistant tokens"
                           + (f" within the first {max_length}" if truncated else ""))
    return Tokenized(input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)
