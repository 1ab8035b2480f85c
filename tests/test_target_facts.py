"""Target facts read one way: tiny configs of several families resolve to the right numbers, the manifest
form of a Llama is the dict stores have always recorded, and bad model folders fail in one line."""
import json
from types import SimpleNamespace

import pytest
import transformers
from click.testing import CliRunner
from transformers import GenerationConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from beagle.model import DrafterConfig
from beagle.target_facts import ARCHITECTURE_KEYS, architecture_values, facts_from_config, read_target_facts
from pipeline.cli import main
from tests.tiny import build_tokenizer, tiny_config

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=320)


def _legacy_architecture(folder) -> dict:
    """The architecture dict extraction wrote before target_facts (config.json read by hand)."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    architecture = {key: text.get(key) for key in ARCHITECTURE_KEYS}
    if architecture["head_dim"] is None:
        architecture["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    if architecture["num_key_value_heads"] is None:
        architecture["num_key_value_heads"] = text.get("num_attention_heads")
    if architecture["rope_theta"] is None:
        architecture["rope_theta"] = (text.get("rope_parameters") or {}).get("rope_theta")
    return architecture


def _saved(config, folder):
    config.save_pretrained(str(folder))
    return folder


def test_llama_facts_and_the_manifest_dict_stores_have_always_recorded(tmp_path):
    folder = _saved(tiny_config(), tmp_path / "llama")
    facts = read_target_facts(folder)
    assert (facts.model_type, facts.num_hidden_layers, facts.hidden_size, facts.num_attention_heads,
            facts.num_key_value_heads, facts.head_dim, facts.intermediate_size, facts.vocab_size) == \
        ("llama", 2, 64, 4, 2, 16, 128, 320)
    assert facts.rope_theta == 10000.0 and facts.full_attention_only and facts.sliding_window is None
    assert facts.architecture() == _legacy_architecture(folder)
    assert json.dumps(facts.architecture()) == json.dumps(_legacy_architecture(folder))  # same dataset_id
    # A config.json written by an older transformers: rope_theta at the top, no head_dim, int values kept.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **SHAPE, "rope_theta": 100000,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "eos_token_id": 2}))
    assert json.dumps(read_target_facts(legacy).architecture()) == json.dumps(_legacy_architecture(legacy))


def test_gpt2_names_resolve_through_the_attribute_map(tmp_path):
    facts = read_target_facts(_saved(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=320,
                                                bos_token_id=0, eos_token_id=0), tmp_path))
    assert (facts.model_type, facts.num_hidden_layers, facts.hidden_size, facts.num_attention_heads,
            facts.num_key_value_heads, facts.head_dim, facts.intermediate_size) == ("gpt2", 3, 64, 4, 4, 16, 256)
    assert facts.rope_theta is None and facts.tie_word_embeddings and facts.eos_token_ids == (0,)
    drafter = DrafterConfig.from_architecture(facts.architecture())
    assert (drafter.hidden_size, drafter.intermediate_size, drafter.rope_theta) == (64, 256, 10000.0)


def test_sliding_windows_are_recorded_and_full_attention_keeps_the_old_dict(tmp_path):
    qwen = read_target_facts(_saved(Qwen2Config(**SHAPE), tmp_path / "qwen"))
    assert qwen.full_attention_only and set(qwen.architecture()) == set(ARCHITECTURE_KEYS)
    windowed = read_target_facts(_saved(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=32,
                                                    max_window_layers=1), tmp_path / "qwen_sw"))
    assert windowed.layer_types == ("full_attention", "sliding_attention") and windowed.sliding_window == 32
    assert windowed.architecture()["layer_types"] == ["full_attention", "sliding_attention"]
    mistral = read_target_facts(_saved(MistralConfig(**SHAPE, sliding_window=16), tmp_path / "mistral"))
    assert mistral.layer_types == ("sliding_attention",) * 2 and mistral.architecture()["sliding_window"] == 16


@pytest.mark.skipif(not hasattr(transformers, "Gemma3TextConfig"), reason="transformers without Gemma 3")
def test_gemma3_rope_per_layer_type(tmp_path):
    config = transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 6}, head_dim=16, sliding_window=8)
    facts = read_target_facts(_saved(config, tmp_path))
    assert facts.layer_types.count("full_attention") == 1 and facts.sliding_window == 8
    full = config.rope_parameters["full_attention"]["rope_theta"]
    assert facts.rope_theta == full != config.rope_parameters["sliding_attention"]["rope_theta"]
    assert set(facts.architecture()["rope_parameters"]) == {"full_attention", "sliding_attention"}
    assert DrafterConfig.from_architecture(facts.architecture()).rope_theta == full
    assert architecture_values(config.to_dict()) == facts.architecture()


def test_hf_config_dicts_and_manifest_dicts_size_the_same_drafter(tmp_path):
    config = tiny_config()
    facts = read_target_facts(_saved(config, tmp_path))
    assert DrafterConfig.from_architecture(config.to_dict()) == DrafterConfig.from_architecture(facts.architecture())
    partial = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 50}
    assert architecture_values(partial)["head_dim"] == 8 and architecture_values(partial)["num_key_value_heads"] == 4
    custom = {**partial, "model_type": "has-its-own-code", "rope_parameters": {"rope_theta": 5.0}}
    assert architecture_values(custom)["rope_theta"] == 5.0  # a remote-code config dict is read as stored


def test_generation_config_eos_ids_join_the_config_ones(tmp_path):
    folder = _saved(LlamaConfig(**SHAPE, eos_token_id=2), tmp_path)
    GenerationConfig(eos_token_id=[2, 7]).save_pretrained(str(folder))
    assert read_target_facts(folder).eos_token_ids == (2, 7)


def test_missing_facts_and_bad_folders_fail_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^--model /m: the toy config has no 'hidden_size'"):
        facts_from_config(SimpleNamespace(model_type="toy", num_hidden_layers=2), where="--model /m")
    with pytest.raises(ValueError, match=f"--model {tmp_path}: no config.json"):
        read_target_facts(tmp_path)
    cases = {"unknown": {"model_type": "not-a-model", "hidden_size": 8},
             "untyped": {"hidden_size": 8}, "broken": None}
    expected = {"unknown": "model_type 'not-a-model' is unknown to transformers", "untyped": "has no model_type",
                "broken": "not valid JSON"}
    for name, config in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text("{oops" if config is None else json.dumps(config))
        with pytest.raises(ValueError) as error:
            read_target_facts(folder)
        assert str(error.value).startswith(f"--model {folder}: ") and expected[name] in str(error.value)
        assert "\n" not in str(error.value)


def _chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Capital of France?"},
                                             {"role": "assistant", "content": "Paris."}]}) + "\n")
    return path


def test_extract_dry_run_reads_a_gpt2_folder(tmp_path):
    """GPT-2 names its facts n_layer / n_embd; extraction used to die with KeyError: 'num_hidden_layers'."""
    folder = tmp_path / "gpt2"
    tokenizer = build_tokenizer(folder)
    from transformers import GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(tokenizer), n_positions=128,
                               bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id)).save_pretrained(str(folder))
    result = CliRunner().invoke(main, ["extract", "--model", str(folder), "--data", str(_chats(tmp_path)),
                                       "--out", str(tmp_path / "store"), "--dry-run", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "samples      1" in result.output


def test_extract_refuses_an_unknown_model_type_in_one_line(tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    (folder / "model.safetensors").write_bytes(b"")
    result = CliRunner().invoke(main, ["extract", "--model", str(folder), "--data", str(_chats(tmp_path)),
                                       "--out", str(tmp_path / "store"), "--dry-run", "--no-progress"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"--model {folder}: model_type 'not-a-model' is unknown" in result.output
