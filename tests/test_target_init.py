"""`train --init-from-target`: the block starts as the target's own decoder layer (beagle/target_init.py), read
from its safetensors by name; a folder that is not the store's target, or not a Llama layout, is refused in one
line before any step."""
import json

import pytest
import torch
from safetensors.torch import save_file

from beagle.drafter_folder import load_drafter
from beagle.model import DrafterConfig
from beagle.registry import form_for
from beagle.target_init import init_from_target
from beagle.train_config import TrainConfig
from beagle.trainer import train
from tests.tiny_store import TINY_ARCH, build_tiny_store, tiny_target

FAST = dict(batch_tokens=160, warmup_steps=0, window_size=3, simulation_steps=2, checkpoint_every=100,
            vocab_chunk=128, stage1_epochs=1, stage2_epochs=0, bf16=False, residual="state")


def _state_drafter(target):
    arch = {k: v for k, v in TINY_ARCH.items() if k in DrafterConfig.__dataclass_fields__}
    config = DrafterConfig(**arch, head_dim=TINY_ARCH["hidden_size"] // TINY_ARCH["num_attention_heads"],
                           key_layers=(1,), residual="state")
    return form_for("beagle", "state").build(config, target.get_input_embeddings().weight.detach(),
                                             target.get_output_embeddings().weight.detach())


@pytest.mark.parametrize("layer", [-1, 0])
def test_the_block_starts_as_the_targets_layer(tmp_path, layer):
    target = tiny_target(0)
    target.save_pretrained(tmp_path / "model")
    drafter = _state_drafter(target)
    names = init_from_target(drafter, tmp_path / "model", layer)
    source = target.model.layers[layer]
    expected = {"q_proj.weight": source.self_attn.q_proj.weight, "o_proj.weight": source.self_attn.o_proj.weight,
                "mlp.down_proj.weight": source.mlp.down_proj.weight,
                "kv_norm.weight": source.input_layernorm.weight,
                "post_attention_norm.weight": source.post_attention_layernorm.weight,
                "output_norm.weight": target.model.norm.weight}
    own = dict(drafter.named_parameters())
    for name, value in expected.items():
        assert name in names and torch.equal(own[name], value.float()), name
    assert "layer_fusion.proj.weight" not in names   # EAGLE-3's fc has no counterpart: it keeps its identity start


def test_training_starts_from_the_target_and_records_it(tmp_path):
    store = build_tiny_store(tmp_path / "store", num_samples=8, layers=(1, -1), model_dir=tmp_path / "model")
    run = tmp_path / "run"
    train([store], run, TrainConfig(**FAST, lr=1e-9, max_steps=1, init_from_target=str(tmp_path / "model")))
    assert json.loads((run / "run_config.json").read_text())["config"]["init_from_target"] == str(tmp_path / "model")
    target = tiny_target(0)
    drafter, _ = load_drafter(run / "drafter", embed_tokens=target.get_input_embeddings().weight,
                              lm_head=target.get_output_embeddings().weight)
    last = target.model.layers[-1]
    assert torch.allclose(drafter.k_proj.weight, last.self_attn.k_proj.weight, atol=1e-6)
    assert torch.allclose(drafter.mlp.up_proj.weight, last.mlp.up_proj.weight, atol=1e-6)


def test_another_model_or_layout_is_refused_in_one_line(tmp_path):
    store = build_tiny_store(tmp_path / "store", num_samples=8, layers=(1, -1), model_dir=tmp_path / "model")
    tiny_target(1).save_pretrained(tmp_path / "other")                      # same shapes, other weights
    with pytest.raises(ValueError, match="not the ones the store was extracted from") as error:
        train([store], tmp_path / "run", TrainConfig(**FAST, max_steps=1, init_from_target=str(tmp_path / "other")))
    assert "\n" not in str(error.value)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    save_file({"transformer.h.0.attn.c_attn.weight": torch.zeros(4, 4)}, str(foreign / "model.safetensors"))
    with pytest.raises(ValueError, match="Llama-layout decoder layers only"):
        init_from_target(_state_drafter(tiny_target(0)), foreign)
    with pytest.raises(ValueError, match="decoder layers 0..1"):
        init_from_target(_state_drafter(tiny_target(0)), tmp_path / "model", layer=5)
