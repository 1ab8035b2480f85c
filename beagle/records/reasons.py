"""Why a record is rejected, said once for every command, and the bounds every reader applies.

Every command that reads records (`extract`, `regenerate`, `eval`) rejects a record it cannot use with one
of these reasons and a short detail; the jobs write them to their rejects file and count them in the
manifest by the reason's value, so the values are part of the store format and must not be renamed.
"""
from __future__ import annotations

import enum

# Large enough for any real conversation (a 1 MB message passes), small enough that one bad line cannot
# exhaust a tokenize worker's memory.
DEFAULT_MAX_RECORD_BYTES = 32 << 20
# Turns of one conversation at most. Finding loss masks costs time that grows faster than the number of
# turns on some templates (transformers' generation-marker path joins strings per block: 10^5 one-character
# turns took 81 s); real conversations have tens of turns, ShareGPT's longest a few hundred.
DEFAULT_MAX_TURNS = 1024
# Nesting of a JSON value at most (a conversation needs 4). A deeper element of a JSON array is rejected as
# malformed: its bytes are read but not built, so a file of a million `[` costs no memory.
MAX_JSON_DEPTH = 128


class RejectReason(enum.StrEnum):
    """A reason a record cannot be used. `str(reason)` is its value; `reason.description` says what it means."""

    description: str

    def __new__(cls, value: str, description: str) -> "RejectReason":
        member = str.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member

    # reading: the bytes of a record
    MALFORMED_JSON = "malformed_json", "a JSONL line or JSON array element that does not parse as JSON (or nests too deeply)"
    INVALID_UTF8 = "invalid_utf8", "a JSONL line whose bytes are not valid UTF-8 (never silently replaced)"
    TOO_LARGE = "too_large", "a record larger than --max-record-bytes (rejected before it is parsed or tokenized)"
    TOO_MANY_TURNS = "too_many_turns", "a conversation of more turns than --max-turns (rejected before it is tokenized)"
    DUPLICATE_ID = "duplicate_id", "a record whose `id` was already seen in the inputs"
    # shape: what the record holds
    NOT_AN_OBJECT = "not_an_object", "a record that is not a JSON object / mapping"
    MISSING_FIELD = "missing_field", ("none of `conversations`, `messages`, `turns`, `prompt` or `text` (the keys "
                                      "a command reads), or a turn without its role/content")
    WRONG_TYPE = "wrong_type", "a field of the wrong type (e.g. a turn's content that is not a string)"
    UNKNOWN_ROLE = "unknown_role", "a turn whose role is not user/assistant/system (e.g. tool, function)"
    EMPTY_CONVERSATION = "empty_conversation", "a conversation with no turns"
    EMPTY_TEXT = "empty_text", "a `text` record whose text is empty"
    INVALID_TEXT = "invalid_text", "text that is not valid Unicode (e.g. a lone surrogate escape such as \\ud800)"
    NO_ASSISTANT_TURN = "no_assistant_turn", "extraction: a conversation with no assistant turn after its first user turn"
    NO_USER_TURN = "no_user_turn", "regeneration and eval: a record without a non-empty user turn to answer"
    # the job's own work on a record
    TEMPLATE_ERROR = "template_error", "the chat template raised on this conversation"
    TOKENIZER_ERROR = "tokenizer_error", "the tokenizer raised on this record"
    TEMPLATE_NOT_PREFIX_STABLE = ("template_not_prefix_stable",
                                  "rendering a prefix of the conversation is not a prefix of the whole")
    NO_LOSS_TOKENS = "no_loss_tokens", "no assistant token is left (after truncation at --max-length)"
    PROMPT_TOO_LONG = "prompt_too_long", "the first turn's prompt is longer than --max-prompt-length tokens"
    NON_FINITE_STATES = ("non_finite_states", "extraction: the target's hidden states of this record hold an inf "
                         "or NaN (it overflows in --dtype, typically float16); never stored")


class RejectRecord(Exception):
    """Raised while reading, normalising or working on one record: the record is rejected, not the job."""

    def __init__(self, reason: RejectReason | str, detail: str = "") -> None:
        self.reason = RejectReason(reason)  # a string that is no reason's value raises ValueError here
        self.detail = detail
        super().__init__(f"{self.reason}: {detail}")

    def as_dict(self, **where) -> dict:
        """The rejects file's row: where the record is (source, index, line), its reason and detail."""
        return {**where, "reason": str(self.reason), "detail": self.detail}
