"""Reading inputs: every format gives the same records; every bad record becomes a reject with a reason."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beagle.records import RejectReason
from tests.read_all import read_inputs

REJECT_REASONS = {reason.value for reason in RejectReason}

CHATS = [
    {"id": "s1", "conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "gpt", "value": "leading"},
                       {"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."},
                       {"from": "human", "value": "trailing question"}]},
    {"id": 7, "messages": [{"role": "user", "content": [{"type": "text", "text": "Write "},
                                                        {"type": "text", "text": "a poem"}]},
                           {"role": "assistant", "content": "The sea."}]},
    {"text": "The quick brown fox."},
]
EXPECTED = [
    ("s1", (("user", "Hello"), ("assistant", "Hi!")), None, 0),
    (None, (("system", "Be brief."), ("user", "Capital of France?"), ("assistant", "Paris.")), None, 1),
    ("7", (("user", "Write a poem"), ("assistant", "The sea.")), None, 0),
    (None, None, "The quick brown fox.", 0),
]


def _write(tmp_path, kind):
    if kind == "jsonl":
        path = tmp_path / "chats.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    elif kind == "json":
        path = tmp_path / "chats.json"
        path.write_text(json.dumps(CHATS))
    elif kind == "parquet":
        path = tmp_path / "chats.parquet"
        rows = [{"id": str(r.get("id")) if "id" in r else None, "conversations": r.get("conversations"),
                 "messages": [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                               else "".join(p["text"] for p in m["content"])} for m in r["messages"]]
                 if "messages" in r else None, "text": r.get("text")} for r in CHATS]
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import datasets
        path = tmp_path / "chats_ds"
        rows = [{"id": str(r.get("id")) if "id" in r else None, "conversations": r.get("conversations"),
                 "text": r.get("text")} for r in CHATS]
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "datasets"])
def test_every_format_reads_the_same_records(tmp_path, kind):
    path = _write(tmp_path, kind)
    result = read_inputs([str(path)])
    assert result.rejects == [] or kind == "datasets" and [r["reason"] for r in result.rejects] == ["missing_field"]
    expected = [e for e in EXPECTED if not (kind == "datasets" and e[0] == "7")]  # no `messages` column there
    assert len(result.records) == len(expected)
    for record, (sample_id, messages, text, dropped) in zip(result.records, expected):
        assert record.sample_id == (sample_id or f"{path.name}:{record.index}")
        assert record.messages == messages and record.text == text
        assert record.dropped_leading_assistant == dropped
    assert result.sources[0]["records"] == len(CHATS) and len(result.sources[0]["sha256"]) == 64


BAD_LINES = {
    "malformed_json": '{"conversations": [',
    "not_an_object": '[1, 2]',
    "missing_field": '{"title": "no conversation here"}',
    "wrong_type": '{"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]}',
    "unknown_role": '{"conversations": [{"from": "tool", "value": "x"}, {"from": "gpt", "value": "y"}]}',
    "empty_conversation": '{"conversations": []}',
    "empty_text": '{"text": "   "}',
    "invalid_text": '{"conversations": [{"from": "human", "value": "bad \\ud800"}, {"from": "gpt", "value": "y"}]}',
    "no_assistant_turn": '{"conversations": [{"from": "gpt", "value": "only a leading reply"}, {"from": "human", "value": "q"}]}',
    "duplicate_id": '{"id": "s1", "text": "again"}',
}


def test_every_read_reject_reason_is_recorded_with_file_and_line(tmp_path):
    path = tmp_path / "crawl.jsonl"
    lines = ['{"id": "s1", "text": "first"}'] + list(BAD_LINES.values()) + ["", '{"text": "last"}']
    path.write_text("\n".join(lines) + "\n")
    result = read_inputs([str(path)])
    assert [r.sample_id for r in result.records] == ["s1", f"crawl.jsonl:{len(lines) - 1}"]
    assert [r["reason"] for r in result.rejects] == list(BAD_LINES)
    for number, reject in enumerate(result.rejects, start=2):
        assert reject["source"] == str(path) and reject["line"] == number and reject["index"] == number - 1
        assert reject["reason"] in REJECT_REASONS
    assert result.sources[0]["records"] == len(lines) - 1  # the blank line is not a record


def test_limit_and_derived_ids_are_stable_across_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder, text in (("a", "one"), ("b", "two")):
        (tmp_path / folder / "x.jsonl").write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": text}) + "\n")
    paths = [str(tmp_path / "a" / "x.jsonl"), str(tmp_path / "b" / "x.jsonl")]
    first, again = read_inputs(paths), read_inputs(paths)
    ids = [r.sample_id for r in first.records]
    assert ids == [r.sample_id for r in again.records] and len(set(ids)) == 4  # same basename: hash in the id
    assert [r.text for r in read_inputs(paths, limit=3).records] == ["one", "one", "two"]


def test_unreadable_inputs_fail_at_once_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl: no such file"):
        read_inputs([str(tmp_path / "nope.jsonl")])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="data.csv: unknown format"):
        read_inputs([str(tmp_path / "data.csv")])
    (tmp_path / "broken.json").write_text("[{\"text\": ")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        read_inputs([str(tmp_path / "broken.json")])


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "datasets"])
def test_records_over_the_size_limit_are_rejected_as_too_large(tmp_path, kind):
    """Every format: a record larger than --max-record-bytes is a `too_large` reject (JSONL lines before
    they are even decoded), the others are read as usual."""
    CHATS.append({"id": "huge", "text": "y" * 5000})
    try:
        path = _write(tmp_path, kind)
    finally:
        CHATS.pop()
    default = read_inputs([str(path)])  # admits it (the datasets rows carry no `messages`: one reject there)
    result = read_inputs([str(path)], max_record_bytes=4000)
    [too_large] = [r for r in result.rejects if r["reason"] == "too_large"]
    assert "--max-record-bytes 4,000" in too_large["detail"] and too_large["index"] == len(CHATS)
    assert len(result.rejects) == len(default.rejects) + 1
    assert [r.sample_id for r in result.records] == [r.sample_id for r in default.records][:-1]
    assert default.records[-1].text == "y" * 5000


def test_invalid_utf8_is_rejected_not_replaced(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 latin-1"}\n{"text": "also fine \xc3\xa9"}\n')
    result = read_inputs([str(path)])
    assert [r.text for r in result.records] == ["fine", "also fine é"]
    assert [(r["reason"], r["line"]) for r in result.rejects] == [("invalid_utf8", 2)]
    assert "line 2: byte 13 is not UTF-8" in result.rejects[0]["detail"]


class _ShortReads:
    """A binary file whose reads return at most `block` bytes: the parser's buffers end anywhere."""

    def __init__(self, handle, block):
        self.handle, self.block = handle, block

    def read(self, size=-1):
        return self.handle.read(self.block if size < 0 else min(size, self.block))


def test_a_json_array_is_read_element_by_element_across_any_block_boundary(tmp_path):
    """.json arrays are streamed through ijson (bounded memory): every buffer boundary must parse as json.load
    does, integers beyond 64 bits included (yajl refuses them; the Python backend takes over)."""
    import random

    from beagle.records.json_arrays import json_array_items

    rng = random.Random(0)

    def value(depth=0):
        roll = rng.random()
        if depth > 3 or roll < 0.3:
            return rng.choice([1, -2.5e10, 12345678901234567890123, 'a"b\\é ✓ \U0001F600', True, None, 0.1, ""])
        if roll < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randint(0, 4))}

    path = tmp_path / "rows.json"
    for _ in range(60):
        rows = [value() for _ in range(rng.randint(0, 12))]
        path.write_text(json.dumps(rows, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5))
        for block in (1, 3, 7, 1 << 20):
            assert list(json_array_items(path, max_element_bytes=10**6, reader=lambda h: _ShortReads(h, block))) == rows
    for broken in ("[1,]", "[1 2]", "[", "[1,", "[1] x", '["abc', "[1]]", "[,1]", "[-2.5e]", "{}", ""):
        path.write_text(broken)
        for block in (1, 3, 100):
            with pytest.raises(ValueError):
                list(json_array_items(path, max_element_bytes=10**6, reader=lambda h: _ShortReads(h, block)))
    path.write_text(json.dumps([{"text": "x" * 5000}, 1]))
    rows = list(json_array_items(path, max_element_bytes=1000, reader=lambda h: _ShortReads(h, 64)))
    assert rows[0].reason == "too_large" and rows[1] == 1  # the element is not built; the next one is read


def test_json_array_guards_what_yajl_would_change_or_choke_on(tmp_path):
    """A lone surrogate escape survives (rejected later as invalid_text, never replaced by '?'), and an element
    nested a million levels deep is read in flat memory and rejected alone."""
    from beagle.records.json_arrays import ArrayStats, json_array_items

    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"text": "bad \\ud800 escape"}, {"text": "pair \\ud83d\\ude00"}]')
    stats = ArrayStats()
    assert list(json_array_items(path, max_element_bytes=10**6, stats=stats)) == [
        {"text": "bad \ud800 escape"}, {"text": "pair \U0001F600"}]
    assert stats.backend == "python"
    depth = 10**6
    path.write_bytes(b"[" + b"[" * depth + b"]" * depth + b', {"text": "after"}]')
    rows = list(json_array_items(path, max_element_bytes=10**8))
    assert rows[0].reason == "malformed_json" and "nested" in rows[0].detail and rows[1] == {"text": "after"}
    result = read_inputs([str(path)])
    assert [r.text for r in result.records] == ["after"] and result.rejects[0]["reason"] == "malformed_json"
    path.write_bytes(b'[{"text": "kept"}, {"text": "cut')
    stats = ArrayStats()
    assert list(json_array_items(path, max_element_bytes=10**6, allow_truncated=True,
                                 stats=stats)) == [{"text": "kept"}]
    assert stats.truncated and not stats.closed
