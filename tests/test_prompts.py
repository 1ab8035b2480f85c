"""One prompt-record parser serves eval (`load_prompts`) and regenerate (`normalize_prompt_record`)."""
import json

import pytest

from beagle.prompts import PROMPT_REJECT_REASONS, PromptRecordError, load_prompts, parse_prompt_record
from pipeline.regenerate.prompts import REGENERATE_REJECT_REASONS, RejectPrompt, normalize_prompt_record

SHAREGPT = {"id": "chat", "conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
    {"from": "system", "value": "late system"}, {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}


def test_shapes_parse_to_messages_with_extract_roles():
    parsed = parse_prompt_record(SHAREGPT)
    assert parsed.prompt_id == "chat" and parsed.shape == "conversations"
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "system", "user", "assistant"]
    assert parse_prompt_record({"question_id": 81, "turns": ["a", "b"]}).messages == (
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    assert parse_prompt_record({"prompt": "p"}).prompt_id is None
    for bad, reason in (([], "not_an_object"), ({"title": "x"}, "missing_field"), ({"prompt": 3}, "wrong_type"),
                        ({"messages": [{"role": "tool", "content": "x"}]}, "unknown_role"),
                        ({"prompt": "\ud800"}, "invalid_text")):
        with pytest.raises(PromptRecordError) as error:
            parse_prompt_record(bad)
        assert error.value.reason == reason
    assert parse_prompt_record({"messages": [{"role": "tool", "content": "x"}]}, keep_unknown_roles=True)
    assert set(PROMPT_REJECT_REASONS) <= set(REGENERATE_REJECT_REASONS)


def test_regenerate_keeps_the_system_prompt_and_user_turns_and_eval_the_history(tmp_path):
    record = normalize_prompt_record(SHAREGPT, source="f", index=0, default_id="f:0")
    assert (record.sample_id, record.system, record.turns) == ("chat", ("Be brief.",), ("Q1", "Q2"))
    with pytest.raises(RejectPrompt) as error:
        normalize_prompt_record({"prompt": "  "}, source="f", index=1, default_id="f:1")
    assert error.value.reason == "no_user_turn"
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(SHAREGPT) + "\n")
    (item,) = load_prompts(path)
    assert item.turns == ("Q2",) and [m["content"] for m in item.history] == ["Be brief.", "Q1", "A1",
                                                                               "late system"]
