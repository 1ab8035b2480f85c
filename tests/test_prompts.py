"""One records module for every command: eval (`load_prompts`), regenerate (`normalize_prompt_record`) and
extract (`normalize_record`) parse records with `beagle.records.parse_record`, read every input format, and
reject with one `RejectReason` enum."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beagle.errors import InputError
from beagle.prompts import load_prompts
from beagle.records import RejectReason, RejectRecord, parse_record
from pipeline.extract.inputs import normalize_record
from pipeline.regenerate.prompts import normalize_prompt_record

SHAREGPT = {"id": "chat", "conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
    {"from": "system", "value": "late system"}, {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}
PARTS = {"id": "parts", "messages": [
    {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
    {"role": "assistant", "content": "Hi."}]}


def test_shapes_parse_to_messages_with_one_role_map():
    parsed = parse_record(SHAREGPT)
    assert parsed.record_id == "chat" and parsed.shape == "conversations"
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "system", "user", "assistant"]
    assert parse_record({"question_id": 81, "turns": ["a", "b"]}).messages == (
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    assert parse_record({"prompt": "p"}).record_id is None
    for bad, reason in (([], "not_an_object"), ({"title": "x"}, "missing_field"), ({"prompt": 3}, "wrong_type"),
                        ({"messages": [{"role": "tool", "content": "x"}]}, "unknown_role"),
                        ({"prompt": "\ud800"}, "invalid_text"), ({"conversations": []}, "empty_conversation"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "wrong_type")):
        with pytest.raises(RejectRecord) as error:
            parse_record(bad)
        assert error.value.reason == reason and isinstance(error.value.reason, RejectReason)
    assert parse_record({"messages": [{"role": "tool", "content": "x"}]}, keep_unknown_roles=True)


def test_every_command_accepts_openai_content_parts():
    """extract accepted text content parts; regenerate and eval refused them. Now all three read them."""
    record = normalize_record(PARTS, source="f", index=0, default_id="f:0")
    assert record.messages == (("user", "Hello, world"), ("assistant", "Hi."))
    prompt = normalize_prompt_record(PARTS, source="f", index=0, default_id="f:0")
    assert prompt.turns == ("Hello, world",)


def test_regenerate_keeps_the_system_prompt_and_user_turns_and_eval_the_history(tmp_path):
    record = normalize_prompt_record(SHAREGPT, source="f", index=0, default_id="f:0")
    assert (record.sample_id, record.system, record.turns) == ("chat", ("Be brief.",), ("Q1", "Q2"))
    with pytest.raises(RejectRecord) as error:
        normalize_prompt_record({"prompt": "  "}, source="f", index=1, default_id="f:1")
    assert error.value.reason == "no_user_turn"
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(SHAREGPT) + "\n")
    (item,) = load_prompts(path).items
    assert item.turns == ("Q2",) and [m["content"] for m in item.history] == ["Be brief.", "Q1", "A1",
                                                                               "late system"]


def test_extract_points_prompt_only_records_to_regenerate():
    with pytest.raises(RejectRecord, match="regenerate") as error:
        normalize_record({"turns": ["a question"]}, source="f", index=0, default_id="f:0")
    assert error.value.reason == "missing_field"


def _prompt_files(tmp_path):
    """The same three prompts (and one bad record) as JSONL, a JSON array, Parquet and a datasets folder."""
    rows = [{"id": "a", "prompt": "first"}, {"id": "b", "prompt": "second"}, {"id": "bad", "prompt": ""},
            {"id": "c", "prompt": "third"}]
    rows[2] = {"id": "bad", "title": "no prompt here"}
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array = tmp_path / "p.json"
    array.write_text(json.dumps(rows))
    table = pa.table({"id": [r["id"] for r in rows], "prompt": [r.get("prompt") for r in rows]})
    parquet = tmp_path / "p.parquet"
    pq.write_table(table, parquet)
    import datasets
    folder = tmp_path / "p_dataset"
    datasets.Dataset.from_dict(table.to_pydict()).save_to_disk(str(folder))
    return [jsonl, array, parquet, folder]


def test_eval_reads_every_input_format_and_reports_rejects(tmp_path):
    for path in _prompt_files(tmp_path):
        loaded = load_prompts(path, skip_rejects=True)
        assert [item.turns for item in loaded.items] == [("first",), ("second",), ("third",)], path
        assert [(r["index"], r["reason"]) for r in loaded.rejects] == [(2, "missing_field")], path
        assert [item.turns for item in load_prompts(path, limit=2, skip_rejects=True).items] == [("first",),
                                                                                                 ("second",)]
        with pytest.raises(InputError, match=f"{path.name}.*missing_field"):
            load_prompts(path)  # without skip_rejects the first bad record stops it, named


def test_every_reject_reason_is_one_enum_member_with_a_description():
    values = [reason.value for reason in RejectReason]
    assert len(values) == len(set(values)) and all(reason.description for reason in RejectReason)
    with pytest.raises(ValueError):
        RejectRecord("a_reason_nobody_defined")
