"""Hostile input files against the extraction reader and the chat tokenizer (hypothesis, no Ray).

Properties: reading never raises for any line, every non-blank line becomes a record or a reject with a
known reason, tokenizing never raises, every record becomes a sample or a reject, and the counts add up.
"""
import json
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.extract.actor import tokenize_records
from beagle.records import RejectReason
from tests.read_all import read_inputs

REJECT_REASONS = {reason.value for reason in RejectReason}
from tests.tiny import build_tokenizer

ROLES = ["human", "user", "gpt", "assistant", "system", "model", "tool", "function", "", "USER", "Gpt"]
KEYS = ["id", "conversations", "messages", "text", "from", "value", "role", "content", "type", "extra"]

# Text with control characters, lone surrogates, odd spaces, and template-looking syntax.
hostile_text = st.one_of(
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40),
    st.text(alphabet=string.printable + "\x00\x01\x1b\x7f\u2028\u202e\ufeff\ud800\udfff", max_size=40),
    st.sampled_from(["{{ raise_exception('x') }}", "{% for %}", "<|im_start|>", "<|im_end|>", "</s>", " ", "",
                     "\n\n", "a" * 5000]),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), hostile_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), inner, max_size=4)),
    max_leaves=20)


@st.composite
def turns(draw, role_key: str, content_key: str):
    turn = {}
    if draw(st.integers(0, 9)):
        turn[role_key] = draw(st.sampled_from(ROLES) | scalars)
    if draw(st.integers(0, 9)):
        turn[content_key] = draw(hostile_text | json_values | st.just([{"type": "text", "text": "hi"}]))
    return turn if draw(st.integers(0, 19)) else draw(json_values)


@st.composite
def records(draw):
    kind = draw(st.sampled_from(["sharegpt", "openai", "text", "junk"]))
    record = {}
    if draw(st.booleans()):
        record["id"] = draw(st.sampled_from(["a", "b", "dup", 1, 2, True, None, [], "x" * 300]) | scalars)
    if kind == "sharegpt":
        record["conversations"] = draw(st.lists(turns("from", "value"), max_size=5) | json_values)
    elif kind == "openai":
        record["messages"] = draw(st.lists(turns("role", "content"), max_size=5) | json_values)
    elif kind == "text":
        record["text"] = draw(hostile_text | json_values)
    else:
        return draw(json_values)
    return record


def _line(draw_value) -> bytes:
    return json.dumps(draw_value, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


lines = st.one_of(
    records().map(_line),
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" ").replace(b"\r", b" ")),  # invalid UTF-8
    st.sampled_from([b"[" * 5000 + b"]" * 5000,  # nesting deeper than the parser's recursion limit
                     b'{"id": ' + b"9" * 5000 + b', "text": "big int"}',  # beyond int parsing limits
                     b'{"text": "\xff\xfe not utf-8"}', b'{"text": "a"} trailing', b"\x00" * 10, b"   ", b"",
                     b'{"id": "dup", "text": "first"}', b'{"id": "dup", "text": "second"}']),
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="chatml")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(body=st.lists(lines, max_size=12))
def test_hostile_jsonl_is_read_and_tokenized_without_crashing(tmp_path_factory, tokenizer, body):
    path = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
    path.write_bytes(b"\n".join(body) + b"\n")
    # Lines end at \n only (\u2028 is not a line end), and a blank line is blank as bytes: \x1c-\x1f are
    # whitespace to str.strip but not to JSON, so such a line is a malformed_json reject, not skipped.
    # A UTF-8 BOM opening the file is not part of the first line (a BOM-only line is blank).
    expected = sum(1 for line in path.read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n") if line.strip())

    read = read_inputs([str(path)])
    assert len(read.records) + len(read.rejects) == expected == read.sources[0]["records"]
    assert all(r["reason"] in REJECT_REASONS and r["source"] == str(path) for r in read.rejects)
    ids = [r.sample_id for r in read.records]
    assert len(ids) == len(set(ids))  # duplicated ids: the first is kept, the rest rejected
    for record in read.records:
        assert record.messages is not None or record.text is not None
        for role, content in record.messages or ():
            assert role in ("user", "assistant", "system") and isinstance(content, str)

    results = tokenize_records(tokenizer, read.records, max_length=64)
    assert len(results) == len(read.records)
    for kind, value in results:
        assert kind in ("sample", "reject")
        if kind == "reject":
            assert value["reason"] in REJECT_REASONS and value["detail"] is not None
            assert value["reason"] != "tokenizer_error", value  # the actor's catch-all must never be needed
        else:
            assert 0 < len(value["input_ids"]) <= 64 and value["loss_mask"].any()
            assert np.asarray(value["input_ids"]).max() < len(tokenizer)


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


valid_text = hostile_text.filter(_valid)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(turns=st.integers(50, 64), texts=st.lists(valid_text, min_size=4, max_size=8), big=st.integers(-1, 63),
       system=st.booleans())
def test_long_and_huge_valid_conversations_become_samples(tmp_path_factory, tokenizer, turns, texts, big, system):
    """50+ turns of hostile but valid text, one of them a 1 MB string: read, tokenized (loss masks found in
    linear time) and stored as a sample; never a tokenizer_error, which would mean a bug turned into a
    reject by the tokenize task's catch-all."""
    messages = [{"role": "system", "content": texts[0]}] if system else []
    for i in range(turns):
        content = texts[i % len(texts)] + f" {i}"
        if i == big:
            content = (content + " ") * (1_000_000 // (len(content) + 1) + 1)  # ~1 MB
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    path = tmp_path_factory.mktemp("long") / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "messages": messages}, ensure_ascii=False) + "\n", encoding="utf-8")
    read = read_inputs([str(path)])
    assert not read.rejects and len(read.records) == 1
    [(kind, value)] = tokenize_records(tokenizer, read.records, max_length=1 << 21)
    assert kind == "sample", value
    assert value["loss_mask"].any() and not value["truncated"]


def test_the_generators_do_reach_every_kind_of_outcome(tmp_path, tokenizer):
    """Guard against a vacuous property: hand-picked hostile lines hit both sides of every count."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join([
        b"[" * 5000 + b"]" * 5000, b'{"id": ' + b"9" * 5000 + b"}", b'{"text": "\xff\xfe"}', b"\x00",
        b'{"id": "dup", "text": "ok"}', b'{"id": "dup", "text": "again"}', b'{"text": "\\ud800"}',
        json.dumps({"conversations": [{"from": "tool", "value": "x"}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "hi\x00\x1b"},
                                 {"role": "assistant", "content": "yo\u202e"}]}).encode(),
    ]) + b"\n")
    read = read_inputs([str(path)])
    reasons = [r["reason"] for r in read.rejects]
    assert reasons.count("malformed_json") >= 2 and "duplicate_id" in reasons and "invalid_text" in reasons
    assert "unknown_role" in reasons and "invalid_utf8" in reasons
    results = tokenize_records(tokenizer, read.records, max_length=64)
    assert [kind for kind, _ in results].count("sample") >= 2


def test_a_hostile_json_array_element_is_rejected_alone_and_a_broken_file_named(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 5000 + "]" * 5000)  # one element nested 4,999 deep
    read = read_inputs([str(path)])
    assert read.records == [] and [r["reason"] for r in read.rejects] == ["malformed_json"]
    path.write_text('[{"text": "fine"}, {"text": oops}]')
    with pytest.raises(ValueError, match=r"deep.json: not valid JSON \(.*after element 1\)"):
        read_inputs([str(path)])
