"""A drafter folder carries the checksum of its weights (config.json's `weights`, as a store lists its files),
and every load path checks it: a flipped byte in the tensors' data, which safetensors' own header checks cannot
see, is one line naming the file and the fix from `eval`, `export --format native` and `export --format eagle3`."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dataclasses import replace

from beagle.drafter_folder import WEIGHTS_ENTRY, load_drafter, read_weights, save_drafter
from beagle.model import DrafterConfig
from beagle.registry import FORMS
from pipeline.cli import main
from tests.decoding_helpers import chat_tokenizer_dir, tiny_target, write_jsonl


@pytest.fixture
def folder(tmp_path):
    tokenizer = chat_tokenizer_dir(tmp_path / "target", words=40)
    target = tiny_target(vocab_size=len(tokenizer), seed=2)
    target.save_pretrained(tmp_path / "target")
    config = replace(DrafterConfig.from_architecture(target.config.to_dict()), residual="state", key_layers=(1,))
    head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    save_drafter(tmp_path / "run" / "drafter", FORMS["beagle-state"].build(config, *head), metadata={})  # every format
    return tmp_path, target


def _flip_a_data_byte(weights) -> None:
    payload = bytearray(weights.read_bytes())
    payload[-5] ^= 0x10  # inside the last tensor's values: the header and the length stay valid
    weights.write_bytes(bytes(payload))


def test_the_checksum_is_recorded_and_a_whole_folder_loads(folder):
    root, target = folder
    drafter = root / "run" / "drafter"
    entry = json.loads((drafter / "config.json").read_text())[WEIGHTS_ENTRY]
    assert set(entry) == {"bytes", "blake3"} and entry["bytes"] == (drafter / "model.safetensors").stat().st_size
    load_drafter(drafter, embed_tokens=target.get_input_embeddings().weight, lm_head=target.get_output_embeddings().weight)


def test_a_flipped_data_byte_is_refused_by_every_load_path(folder):
    root, target = folder
    drafter = root / "run" / "drafter"
    _flip_a_data_byte(drafter / "model.safetensors")
    read_weights(drafter / "model.safetensors")  # safetensors alone sees nothing wrong
    with pytest.raises(ValueError, match="differs from the .* its config.json records; the drafter folder is damaged"):
        load_drafter(drafter, embed_tokens=target.get_input_embeddings().weight,
                     lm_head=target.get_output_embeddings().weight)
    prompts = write_jsonl(root / "p.jsonl", [{"prompt": "w1 w2"}])
    runner = CliRunner()
    for args in (["export", str(root / "run"), "--format", "native", "--out", str(root / "n")],
                 ["export", str(root / "run"), "--format", "eagle3", "--target", str(root / "target"), "--out",
                  str(root / "e")],
                 ["eval", "--model", str(root / "target"), "--drafter", str(drafter), "--prompts", str(prompts),
                  "--max-new-tokens", "4", "--no-progress"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 1, result.output
        last = result.output.strip().splitlines()[-1]
        assert "model.safetensors" in last and "re-export it or retrain" in last, result.output
    assert not (root / "n").exists() and not (root / "e").exists()


def test_a_folder_written_before_checksums_still_loads_and_a_wrong_length_is_named(folder):
    root, target = folder
    drafter = root / "run" / "drafter"
    config = json.loads((drafter / "config.json").read_text())
    entry = config.pop(WEIGHTS_ENTRY)
    (drafter / "config.json").write_text(json.dumps(config))
    head = dict(embed_tokens=target.get_input_embeddings().weight, lm_head=target.get_output_embeddings().weight)
    load_drafter(drafter, **head)
    (drafter / "config.json").write_text(json.dumps({**config, WEIGHTS_ENTRY: {**entry, "bytes": entry["bytes"] + 1}}))
    with pytest.raises(ValueError, match=f"holds {entry['bytes']} bytes, its config.json records {entry['bytes'] + 1}"):
        load_drafter(drafter, **head)
