"""Keys that hold their token (`--key-tokens`): each key is RMSNorm_kv(h_j) + RMSNorm_tok(Emb(t_j)).

Why it exists and what it gains is in docs/training.md ("Keys that hold their token"). Here: the keys
depend on their tokens only when asked; a chain drafted through the decoding cache matches training's
simulation; a run records the option, and its export decodes exactly like plain decoding. The cache after
rejections is checked in tests/test_decoding.py (test_caches_match_a_fresh_forward_after_rejections).
"""
import json
from dataclasses import replace

import pytest
import torch

from bench.acceptance import _beagle_chain_tokens
from beagle.data import StoreSet, collate
from beagle.decoding import DraftConfig, plain_generate, speculative_generate
from beagle.decoding.drafters import BeagleBackend
from beagle.export import load_drafter
from beagle.model import BeagleDrafter, DrafterConfig
from beagle.train_config import TrainConfig
from beagle.trainer import train
from tests.decoding_helpers import tiny_target
from tests.tiny_store import build_tiny_store
from tests.tiny_store import tiny_target as store_target


def _drafter(target, key_tokens: bool) -> BeagleDrafter:
    torch.manual_seed(1)
    config = replace(DrafterConfig.from_architecture(target.config.to_dict()), key_tokens=key_tokens)
    drafter = BeagleDrafter(config, target.get_input_embeddings().weight.detach(),
                            target.get_output_embeddings().weight.detach())
    drafter.reset_parameters(std=0.2)
    return drafter.eval()


@torch.inference_mode()
def test_keys_depend_on_their_tokens_only_when_asked():
    target = tiny_target()
    states = torch.randn(1, 5, target.config.hidden_size)
    positions = torch.arange(5)[None]
    tokens_a, tokens_b = torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 2, 9, 4, 5]])
    plain = _drafter(target, key_tokens=False)
    assert torch.equal(plain.project_keys(states, positions, tokens_a)[0], plain.project_keys(states, positions)[0])
    with_tokens = _drafter(target, key_tokens=True)
    k_a, v_a = with_tokens.project_keys(states, positions, tokens_a)
    k_b, v_b = with_tokens.project_keys(states, positions, tokens_b)
    changed = (k_a != k_b).flatten(0, 1).any(-1).any(0)                    # [L]: positions whose key moved
    assert changed.tolist() == [False, False, True, False, False]
    assert not torch.equal(v_a, v_b)
    with pytest.raises(ValueError, match="pass the token of each state"):
        with_tokens.project_keys(states, positions)


FAST = dict(batch_tokens=160, lr=3e-3, warmup_steps=3, window_size=3, simulation_steps=2, checkpoint_every=100,
            vocab_chunk=128, stage1_epochs=1, stage2_epochs=1, max_steps=6, bf16=False, key_tokens=True)
SHAPES = {"chain": DraftConfig.chain(depth=3), "tree": DraftConfig(depth=3, top_k=3, total_tokens=8)}


def test_a_key_tokens_run_records_the_option_and_decodes_exactly(tmp_path):
    """Both stages -> export -> greedy decoding with the drafter equals plain decoding, chain and tree."""
    store = build_tiny_store(tmp_path / "store", num_samples=12)
    run = tmp_path / "run"
    train([store], run, TrainConfig(**FAST), draw_curves=False)
    assert json.loads((run / "drafter" / "config.json").read_text())["key_tokens"] is True
    target = store_target(0)                                                  # the store's target
    drafter, _ = load_drafter(run / "drafter", embed_tokens=target.get_input_embeddings().weight,
                              lm_head=target.get_output_embeddings().weight)
    assert drafter.config.key_tokens and drafter.key_token_norm is not None
    prompt = torch.tensor([3, 7, 11, 12, 14])
    plain = plain_generate(target, prompt, 20, set()).tokens
    for name, shape in SHAPES.items():
        assert speculative_generate(target, drafter, prompt, 20, set(), shape).tokens == plain, name


def test_key_tokens_is_refused_for_the_eagle2_baseline():
    with pytest.raises(ValueError, match="key_tokens is a Beagle option"):
        TrainConfig(drafter="eagle2", key_tokens=True)


def test_decode_time_chain_matches_the_training_simulation(tmp_path):
    """A chain drafted through the decoding backend (true keys from the cache, each drafted state fed back as
    a key with its own token) drafts the same tokens as the training-time simulation of that window."""
    url = build_tiny_store(tmp_path / "s", num_samples=1, min_len=14, max_len=14)
    data = StoreSet([url])
    head = data.load_head()
    torch.manual_seed(0)
    config = replace(DrafterConfig.from_architecture(data.target["architecture"]), key_tokens=True)
    model = BeagleDrafter(config, head["embed_tokens"], head["lm_head"])
    model.reset_parameters(std=0.1)
    model.eval()
    batch = collate([data.sample(0, 100)])
    ids, states = batch.input_ids[0], batch.hidden[0]
    depth, n = 3, 5
    with torch.no_grad():
        offline = _beagle_chain_tokens(model, batch, depth)[(n + 1) % depth][0]   # [L]: token drafted at p
        backend = BeagleBackend(model, concatenate=True)
        backend.append(states[:n + 1], torch.arange(n + 1), ids[:n + 1])
        keys, values = backend.keys(), backend.values()
        for p in range(n + 1, n + depth + 1):
            mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
            hidden, (k, v) = backend.step(ids[None, p:p + 1], torch.tensor([[p]]), None, keys, values, mask,
                                          need_bank=True)
            assert int(model.logits(hidden).argmax()) == int(offline[p])
            keys, values = torch.cat([keys, k], -2), torch.cat([values, v], -2)
