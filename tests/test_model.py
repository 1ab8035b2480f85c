"""The drafter module: shapes, frozen head, empty attention rows, export round trip."""
import json

import pytest
import torch

from beagle.drafter_folder import load_drafter, save_drafter
from beagle.model import BeagleDrafter, DrafterConfig

ARCH = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None,
        "intermediate_size": 64, "vocab_size": 50, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def _model(seed: int = 0) -> BeagleDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_architecture(ARCH)
    return BeagleDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))


def _inputs(B=2, L=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (B, L), generator=g)
    pos = torch.arange(L).expand(B, L)
    states = torch.randn(B, L, 32, generator=g)
    mask = torch.ones(L, L).tril(-1).bool().expand(B, 1, L, L)  # strictly causal: row 0 sees nothing
    return ids, pos, states, mask


def test_config_from_architecture_defaults_head_dim_and_round_trips():
    cfg = DrafterConfig.from_architecture(ARCH)
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 2
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown DrafterConfig keys"):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_forward_shapes_frozen_head_and_finite_empty_rows():
    model = _model()
    ids, pos, states, mask = _inputs()
    k, v = model.project_keys(states, pos)
    assert k.shape == (2, 2, 7, 8) and v.shape == (2, 2, 7, 8)
    hidden = model.forward_hidden(ids, pos, k, v, mask)
    assert hidden.shape == (2, 7, 32) and torch.isfinite(hidden).all()
    logits = model.logits(hidden)
    assert logits.shape == (2, 7, 50)
    # Row 0 sees no key: its state is the embedding plus the MLP of it, independent of the keys.
    other = model.forward_hidden(ids, pos, *model.project_keys(states * 3 + 1, pos), mask)
    assert torch.equal(hidden[:, 0], other[:, 0]) and not torch.allclose(hidden[:, 1:], other[:, 1:])
    assert not model.embed_tokens.requires_grad and not model.lm_head.requires_grad
    trainable = set(model.state_dict())
    assert "embed_tokens" not in trainable and "lm_head" not in trainable
    assert all(p.requires_grad for p in model.parameters())


def test_gradients_are_finite_with_empty_rows():
    model = _model()
    ids, pos, states, mask = _inputs()
    hidden = model.forward_hidden(ids, pos, *model.project_keys(states, pos), mask)
    hidden.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_export_then_reload_gives_identical_logits(tmp_path):
    model = _model()
    ids, pos, states, mask = _inputs()
    save_drafter(tmp_path / "drafter", model, metadata={"dataset_ids": ["abc"]})
    meta = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert meta["drafter_type"] == "beagle" and meta["dataset_ids"] == ["abc"]
    loaded, meta2 = load_drafter(tmp_path / "drafter", embed_tokens=model.embed_tokens,
                                 lm_head=model.lm_head)
    assert meta2 == meta
    with torch.no_grad():
        a = model.logits(model.forward_hidden(ids, pos, *model.project_keys(states, pos), mask))
        b = loaded.logits(loaded.forward_hidden(ids, pos, *loaded.project_keys(states, pos), mask))
    assert torch.equal(a, b)


def test_load_refuses_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path, embed_tokens=torch.zeros(50, 32), lm_head=torch.zeros(50, 32))


def test_grouped_attention_expanded_equals_broadcast_heads():
    """The CUDA path (KV heads expanded, so the memory-efficient kernel takes the mask) and the CPU path
    (enable_gqa) compute the same attention."""
    from beagle.block import grouped_attention

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=generator)             # [B, H, Lq, hd]
    k, v = torch.randn(2, 2, 7, 16, generator=generator), torch.randn(2, 2, 7, 16, generator=generator)
    mask = torch.rand(2, 1, 5, 7, generator=generator) > 0.4
    mask[..., 0] = True                                             # every row sees a key
    expanded = grouped_attention(q, k, v, mask, expand=True)
    broadcast = grouped_attention(q, k, v, mask, expand=False)
    assert expanded.shape == (2, 8, 5, 16)
    torch.testing.assert_close(expanded, broadcast, rtol=1e-5, atol=1e-6)
