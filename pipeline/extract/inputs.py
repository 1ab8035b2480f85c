"""Read conversation records from JSON, JSONL, Parquet and `datasets` directories.

Reading happens on the driver, as a stream (`RecordStream`): it is cheap next to the target forward, and
it is the one place where a malformed line can be turned into a reject (with its file and line) instead
of killing a Ray read task.
Every record either becomes a `Record` (normalised roles, a stable id) or a reject dict with a reason
from `REJECT_REASONS`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from beagle.prompts import ROLE_NAMES
from pipeline.store.hashing import update_from_file

logger = logging.getLogger(__name__)

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


# Large enough for any real conversation (a 1 MB message passes), small enough that one bad line cannot
# exhaust a tokenize worker's memory.
DEFAULT_MAX_RECORD_BYTES = 32 << 20
# Turns of one conversation at most. Finding loss masks costs time that grows faster than the number of
# turns on some templates (transformers' generation-marker path joins strings per block: 10^5 one-character
# turns took 81 s); real conversations have tens of turns, ShareGPT's longest a few hundred.
DEFAULT_MAX_TURNS = 1024
LINE_BLOCK_BYTES = 1 << 20  # bytes read at a time while skipping the rest of a line over the size limit


class RejectRecord(Exception):
    """Raised while normalising one record; carries the reject reason key and a short detail."""

    reasons: dict[str, str] = REJECT_REASONS  # the keys a reason may take (a subclass brings its own table)

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in self.reasons, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory's files (relative names and bytes, in sorted order)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        update_from_file(digest, file)
    return digest.hexdigest()


def iter_raw_records(path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                     ) -> Iterator[tuple[int, Any, RejectRecord | None, int | None]]:
    """Yield (index, raw object, reject or None, line number or None) for every record.

    JSONL is read as bytes, line by line: a line over `max_record_bytes` is rejected unread, one that is
    not UTF-8 is rejected (not patched with replacement characters), then it is parsed."""
    if path.is_dir():
        import datasets
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as exc:  # noqa: BLE001 - datasets raises several types here
            raise ValueError(f"--data {path}: not a `datasets` directory made by save_to_disk ({exc})") from None
        if isinstance(data, datasets.DatasetDict):
            raise ValueError(f"--data {path}: is a DatasetDict with splits {list(data)}; pass one split "
                             f"directory, e.g. {path / next(iter(data))}")
        for i, row in enumerate(data):
            yield i, row, None, None
        return
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield index, row, None, None
                index += 1
        return
    if suffix == ".json":
        with open(path, "rb") as probe:
            is_array = probe.read(4096).lstrip().startswith(b"[")
        if is_array:
            try:
                # elements a little over the limit are still read, and rejected as too_large record by record
                for i, row in enumerate(json_array_items(path, max_element_chars=4 * max_record_bytes)):
                    yield i, row, None, None
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, int too long, nesting
                raise ValueError(f"--data {path}: not valid JSON ({_parse_error(exc)}); fix the file or convert "
                                 "it to JSONL, where a bad line is rejected on its own") from None
            return
    with open(path, "rb") as handle:  # bytes: a line's size is checked before it is decoded or parsed
        for i, (raw, size) in enumerate(bounded_lines(handle, max_record_bytes)):
            if raw is None:
                yield i, None, RejectRecord("too_large", f"line {i + 1}: {size:,} bytes, more than "
                                            f"--max-record-bytes {max_record_bytes:,}"), i + 1
                continue
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, None, RejectRecord("invalid_utf8", f"line {i + 1}: byte {exc.start} is not UTF-8"), i + 1
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, int too long, nesting too deep
                yield i, None, RejectRecord("malformed_json", f"line {i + 1}: {_parse_error(exc)}"), i + 1
                continue
            yield i, obj, None, i + 1


def bounded_lines(handle: Any, limit: int, block_bytes: int = LINE_BLOCK_BYTES) -> Iterator[tuple[bytes | None, int]]:
    """(line, its size in bytes) for each line of a binary file, its newline included; a line of more than
    `limit` bytes comes as (None, size), having been read in blocks and dropped, never held whole (a file
    of gigabytes with no newline costs `limit` plus a block of memory, not gigabytes)."""
    while True:
        raw = handle.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit:
            yield raw, len(raw)
            continue
        size = len(raw)
        while not raw.endswith(b"\n"):
            raw = handle.readline(block_bytes)
            if not raw:
                break
            size += len(raw)
        yield None, size


def _turns(obj: Any) -> int:
    """The turns of a raw conversation record (0 for anything else), counted before they are normalised."""
    if not isinstance(obj, dict):
        return 0
    turns = obj.get("conversations") if obj.get("conversations") is not None else obj.get("messages")
    return len(turns) if isinstance(turns, list) else 0


def _text_bytes(value: Any) -> int:
    """Bytes of the strings in a parsed row (UTF-8 length bound: 4 per character), iteratively."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += 4 * len(item) if not item.isascii() else len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


JSON_BLOCK_CHARS = 1 << 20  # characters read at a time from a .json array
_WHITESPACE = frozenset(" \t\n\r")
_ELEMENT_ENDS = _WHITESPACE | {",", "]"}


def json_array_items(path: Path, max_element_chars: int, block_chars: int = JSON_BLOCK_CHARS) -> Iterator[Any]:
    """The elements of the top-level JSON array in `path`, parsed one at a time: a .json file of any size is
    read in bounded memory (an element of at most `max_element_chars` plus a block), as JSONL is, and the
    streaming driver's two passes never hold the whole dataset. Raises ValueError (json.JSONDecodeError)
    where the file stops being one valid JSON array, or at an element longer than `max_element_chars` (an
    invalid one is only known invalid once read to its end), after yielding the elements before it."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        text, position, at_end = "", 0, False

        def refill() -> bool:
            """Append a block (dropping what was parsed), at least as long as what is left unparsed, so that
            an element spanning many blocks is parsed O(log) times, not once per block; False at the end."""
            nonlocal text, position, at_end
            block = handle.read(max(block_chars, len(text) - position))
            text, position, at_end = text[position:] + block, 0, not block
            return bool(block)

        def next_character() -> str:
            """The next non-whitespace character, not consumed ('' at the end of the file)."""
            nonlocal position
            while True:
                while position < len(text) and text[position] in _WHITESPACE:
                    position += 1
                if position < len(text) or not refill():
                    return text[position] if position < len(text) else ""

        def fail(message: str) -> json.JSONDecodeError:
            return json.JSONDecodeError(message, text, position)

        if next_character() != "[":
            raise fail("expected '[' to open the array")
        position += 1
        if next_character() == "]":
            position += 1
        else:
            while True:
                while True:  # one element: parsed again with more text until a delimiter shows it complete
                    try:
                        item, end = decoder.raw_decode(text, position)
                        # "-2" of "-2.5e10" parses: an element is whole only once a delimiter follows it
                        if at_end or (end < len(text) and text[end] in _ELEMENT_ENDS):
                            break
                    except json.JSONDecodeError:
                        if at_end:
                            raise
                    if len(text) - position > max_element_chars:
                        raise fail(f"an element longer than {max_element_chars:,} characters, or invalid")
                    refill()
                position = end
                yield item
                separator = next_character()
                if separator not in (",", "]"):
                    raise fail("expected ',' or ']' after an array element")
                position += 1
                if separator == "]":
                    break
                next_character()  # raw_decode does not skip the whitespace before the next element
        if next_character() != "":
            raise fail("extra data after the array")


def _parse_error(exc: Exception) -> str:
    """A short reason for a record the JSON parser refused (hostile input must not crash the reader)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return getattr(exc, "msg", None) or str(exc)[:200]


def check_data_path(path: str) -> Path:
    """Fail at once, naming the file, if an input cannot be read at all."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--data {path}: no such file or directory")
    if p.is_file():
        if p.suffix.lower() not in (".json", ".jsonl", ".ndjson", ".parquet"):
            raise ValueError(f"--data {path}: unknown format {p.suffix!r}; use .json, .jsonl, .parquet "
                             "or a `datasets` save_to_disk directory")
        if not os.access(p, os.R_OK):
            raise ValueError(f"--data {path}: not readable")
    return p


def read_inputs(paths: list[str], *, limit: int | None = None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                max_turns: int | None = DEFAULT_MAX_TURNS) -> ReadResult:
    """Read every input in order into memory; stop once `limit` usable records are collected."""
    return ReadResult(*read_records(paths, normalize_record, limit=limit, max_record_bytes=max_record_bytes,
                                    max_turns=max_turns))


def file_identity(path: Path) -> list[tuple]:
    """What changes whenever a file's bytes may have: device, inode, size, mtime and ctime (ctime cannot
    be set back by hand), of the file or of each file of a directory. Taken before a file is hashed and
    again before the store is committed: equal, the bytes read are the bytes hashed."""
    files = [path] if not path.is_dir() else sorted(p for p in path.rglob("*") if p.is_file())
    identity = []
    for file in files:
        info = file.stat()
        identity.append((str(file), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return identity


@dataclass(frozen=True)
class InputScan:
    """What one pass over the inputs learns without keeping a record: the facts the dataset_id needs before
    anything is written, how many records will reach tokenizing, and whether a chat template is needed."""

    sources: list[dict[str, Any]]  # {"path", "sha256", "records"} per input, as RecordStream reports them
    records: int  # usable records: each becomes a sample or a tokenizing reject
    conversations: bool  # some usable record is a conversation
    identities: list[list[tuple]] = field(default_factory=list)  # file_identity of each input, before hashing


def changed_inputs(scan: InputScan) -> list[str]:
    """The inputs whose file identity is no longer what it was when `scan` hashed them."""
    return [source["path"] for source, identity in zip(scan.sources, scan.identities)
            if file_identity(Path(source["path"])) != identity]


def scan_inputs(paths: list[str], *, limit: int | None = None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                max_turns: int | None = DEFAULT_MAX_TURNS) -> InputScan:
    """Read the inputs once, keeping only counts. Extraction must know the dataset_id (which counts each
    file's records up to `limit`) before it claims a store, and must not hold the records to know it."""
    stream = RecordStream(paths, normalize_record, limit=limit, max_record_bytes=max_record_bytes,
                          max_turns=max_turns)
    conversations = False
    for record in stream:
        conversations = conversations or record.messages is not None
    return InputScan(stream.sources, stream.records, conversations, stream.identities)


def stream_inputs(paths: list[str], scan: InputScan, *, limit: int | None = None,
                  max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                  max_turns: int | None = DEFAULT_MAX_TURNS) -> RecordStream:
    """The records `scan` counted, read again lazily (the files are not hashed a second time)."""
    return RecordStream(paths, normalize_record, limit=limit, max_record_bytes=max_record_bytes,
                        max_turns=max_turns, digests=[source["sha256"] for source in scan.sources])


def read_records(paths: list[str], normalize: Callable[..., Any], *, limit: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_turns: int | None = None,
                 ) -> tuple[list[Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(records, rejects, sources) of every input in order, stopping once `limit` records are usable: a
    `RecordStream` read whole (regeneration, tests); extraction reads the stream as it goes instead."""
    stream = RecordStream(paths, normalize, limit=limit, max_record_bytes=max_record_bytes, max_turns=max_turns)
    records = list(stream)
    return records, stream.rejects, stream.sources


class RecordStream:
    """The usable records of the inputs, in input order, read lazily: one pass over the files per iteration.

    `normalize(obj, source=, index=, default_id=)` turns one raw record into a frozen dataclass with
    `sample_id` and `line` fields, or raises `RejectRecord` (or a subclass with its own reasons); a record
    whose id was already seen is rejected as `duplicate_id`. Reading stops once `limit` records are usable.
    While it is iterated, `rejects` collects the rejected records and `sources` each finished file's
    {"path", "sha256", "records"} (records read from it, rejects included): what the dataset_id hashes.
    What the stream keeps grows with the rejects and the set of ids seen, never with the records.

    `digests`: the files' sha256 from an earlier pass over the same inputs, so a second pass (extraction
    scans its inputs once before it reads them for good) does not hash every file again.
    """

    def __init__(self, paths: list[str], normalize: Callable[..., Any], *, limit: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_turns: int | None = None,
                 digests: list[str] | None = None) -> None:
        self.paths = list(paths)
        self.checked = [check_data_path(p) for p in paths]  # a missing or unreadable input fails at once
        self.normalize = normalize
        self.limit = limit
        self.max_record_bytes = max_record_bytes
        self.max_turns = max_turns
        self.digests = digests
        self.rejects: list[dict[str, Any]] = []
        self.sources: list[dict[str, Any]] = []
        self.identities: list[list[tuple]] = []  # file_identity of each input, taken before it was hashed
        self.records = 0  # usable records yielded so far

    def __iter__(self) -> Iterator[Any]:
        self.rejects, self.sources, self.identities, self.records = [], [], [], 0
        names = [p.name for p in self.checked]
        seen_ids: set[str] = set()
        for k, (given, path) in enumerate(zip(self.paths, self.checked)):
            self.identities.append(file_identity(path))
            digest = self.digests[k] if self.digests is not None else sha256_path(path)
            # Ids derived from position use the file name, or its hash when two inputs share a name.
            prefix = path.name if names.count(path.name) == 1 else f"{path.name}@{digest[:8]}"
            count = 0
            for index, obj, unreadable, line in iter_raw_records(path, max_record_bytes=self.max_record_bytes):
                if self.limit is not None and self.records >= self.limit:
                    break
                count += 1
                record = self._record(obj, unreadable, source=given, index=index, line=line,
                                      default_id=f"{prefix}:{index}", seen_ids=seen_ids)
                if record is not None:
                    seen_ids.add(record.sample_id)
                    self.records += 1
                    yield record
            self.sources.append({"path": given, "sha256": digest, "records": count})
            logger.info("read %s: %d records", given, count)

    def _record(self, obj: Any, unreadable: RejectRecord | None, *, source: str, index: int, line: int | None,
                default_id: str, seen_ids: set[str]) -> Any:
        """One raw record -> the normalised record, or None after adding its reject to `rejects`."""
        where: dict[str, Any] = {"source": source, "index": index}
        if line is not None:
            where["line"] = line
        try:
            if unreadable is not None:
                raise unreadable
            if line is None and _text_bytes(obj) > self.max_record_bytes:  # rows of .json / Parquet / datasets
                raise RejectRecord("too_large", f"{_text_bytes(obj):,} bytes of text, more than "
                                   f"--max-record-bytes {self.max_record_bytes:,}")
            turns = _turns(obj)
            if self.max_turns is not None and turns > self.max_turns:
                raise RejectRecord("too_many_turns", f"{turns:,} turns, more than --max-turns {self.max_turns:,}")
            record = self.normalize(obj, source=source, index=index, default_id=default_id)
            if record.sample_id in seen_ids:
                raise RejectRecord("duplicate_id", f"id {record.sample_id!r} seen before")
        except RejectRecord as reject:
            self.rejects.append({**where, "reason": reject.reason, "detail": reject.detail})
            return None
        return dataclasses.replace(record, line=line) if line is not None else record
