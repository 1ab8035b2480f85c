"""The one loader of a user's target (beagle/target_model.py): local files only, pickled weights only
where torch can load them without running code, one device unless a device_map is asked for."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from beagle import target_model
from beagle.target_model import load_causal_lm, read_head_weights, weight_files
from tests.tiny import build_target
from tests.tiny_families import FAMILIES, family_model

ROOT = Path(__file__).resolve().parent.parent


def _from_pretrained_calls() -> list[tuple[str, int, ast.Call]]:
    calls = []
    for path in [*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "beagle").rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "from_pretrained":
                calls.append((str(path.relative_to(ROOT)), node.lineno, node))
    return calls


def test_every_from_pretrained_is_local_files_only_and_weights_load_in_one_place():
    calls = _from_pretrained_calls()
    assert calls
    for where, line, call in calls:
        keywords = {k.arg: k.value for k in call.keywords}
        assert "local_files_only" in keywords and getattr(keywords["local_files_only"], "value", None) is True, \
            f"{where}:{line}: from_pretrained without local_files_only=True"
    model_loads = {where for where, _, call in calls if ast.unparse(call.func.value).startswith("AutoModel")}
    assert model_loads == {"beagle/target_model.py"}, model_loads


@pytest.fixture(scope="module")
def pickled_target(tmp_path_factory) -> Path:
    """A tiny target whose weights are a pytorch_model.bin (pickle) and nothing else."""
    from transformers import AutoModelForCausalLM

    directory = build_target(tmp_path_factory.mktemp("pickled") / "target")
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    for path in directory.glob("*.safetensors"):
        path.unlink()
    torch.save(model.state_dict(), directory / "pytorch_model.bin")  # what older checkpoints ship
    assert [p.name for p in directory.glob("*.bin")] and not list(directory.glob("*.safetensors"))
    return directory


def test_pickled_weights_are_refused_where_torch_cannot_load_them_safely(pickled_target, monkeypatch):
    monkeypatch.setattr(target_model, "torch_version", lambda: (2, 5))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin is a pickle.*convert it to safetensors") as error:
        load_causal_lm(pickled_target, dtype="float32", device=torch.device("cpu"))
    assert str(pickled_target) in str(error.value) and "\n" not in str(error.value)


def test_pickled_weights_load_through_weights_only_on_this_torch(pickled_target, tmp_path):
    assert target_model.torch_version() >= target_model.SAFE_WEIGHTS_ONLY_TORCH
    assert [p.name for p in weight_files(pickled_target)] == ["pytorch_model.bin"]
    model = load_causal_lm(pickled_target, dtype="float32", device=torch.device("cpu"))
    reference = load_causal_lm(build_target(tmp_path / "safe"), dtype="float32", device=torch.device("cpu"))
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_one_device_without_a_device_map(tmp_path):
    """No device_map unless asked: transformers would need accelerate for `device_map="cuda"`, which a plain
    install lacks (every GPU actor would die at start)."""
    model = load_causal_lm(build_target(tmp_path / "t"), dtype="float32", device=torch.device("cpu"))
    assert getattr(model, "hf_device_map", None) is None
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    assert not model.training


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 128}, r"model\.embed_tokens\.weight is \[320, 64\], the config says \[vocab_size=320, "
                           r"hidden_size=128\]"),
    ({"vocab_size": 400}, r"is \[320, 64\], the config says \[vocab_size=400"),
    ({"num_hidden_layers": 4}, r"they hold 2 decoder layers, the config says num_hidden_layers=4"),
])
def test_weights_that_do_not_match_the_config_are_refused_by_every_command_before_any_worker(
        tmp_path, change, message):
    import json

    from click.testing import CliRunner

    from pipeline.cli import main

    target = build_target(tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **change}))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    for command in (["extract", "--data", str(data), "--out", str(tmp_path / "store")],
                    ["regenerate", "--data", str(data), "--out", str(tmp_path / "answers.jsonl")],
                    ["eval", "--drafter", str(tmp_path), "--prompts", str(data)]):
        result = CliRunner().invoke(main, [command[0], "--model", str(target), *command[1:], "--no-progress"])
        assert result.exit_code != 0, command[0]
        assert f"--model {target}: its weights do not match config.json" in result.output, (command[0], result.output)
        assert re.search(message, result.output), command[0]
        assert "Traceback" not in result.output


def _loaded_head(path, dtype: str) -> dict[str, torch.Tensor]:
    model = load_causal_lm(path, dtype=dtype, device=torch.device("cpu"))
    return {"embed_tokens": model.get_input_embeddings().weight, "lm_head": model.get_output_embeddings().weight}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_head_read_from_the_files_equals_the_loaded_models(family, tmp_path):
    torch.manual_seed(0)
    family_model(family, 96, bos_token_id=1, eos_token_id=1, pad_token_id=0).save_pretrained(str(tmp_path))
    for dtype in ("float32", "bfloat16"):
        read, loaded = read_head_weights(tmp_path, dtype), _loaded_head(tmp_path, dtype)
        assert read is not None, family
        for role in ("embed_tokens", "lm_head"):
            assert read[role].dtype == loaded[role].dtype and torch.equal(read[role], loaded[role]), (family, role)


def test_a_tied_head_saved_once_and_names_without_the_base_prefix_are_found(tmp_path):
    from safetensors.torch import load_file, save_file

    tied = build_target(tmp_path / "tied", tied=True)
    assert "lm_head.weight" not in load_file(str(Path(tied) / "model.safetensors"))
    read = read_head_weights(tied, "float32")
    assert torch.equal(read["lm_head"], _loaded_head(tied, "float32")["lm_head"])
    assert torch.equal(read["lm_head"], read["embed_tokens"])
    # GPT-2 checkpoints from the original conversion name the weights without "transformer."
    gpt2 = tmp_path / "gpt2"
    family_model("gpt2", 96, bos_token_id=1, eos_token_id=1, pad_token_id=0).save_pretrained(str(gpt2))
    weights = load_file(str(gpt2 / "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()}, str(gpt2 / "model.safetensors"),
              metadata={"format": "pt"})
    assert torch.equal(read_head_weights(gpt2, "float32")["embed_tokens"], weights["transformer.wte.weight"])


def test_a_head_not_in_safetensors_files_is_left_to_a_full_load(tmp_path):
    target = build_target(tmp_path / "target")
    (Path(target) / "model.safetensors").rename(Path(target) / "renamed.bin")
    assert read_head_weights(target, "float32") is None
