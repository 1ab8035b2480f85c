"""The EAGLE-2 baseline drafter: masks, causality, loss, decode-time cache, training and export."""
import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from beagle.data import Batch, StoreSet, collate
from beagle.eagle2 import Eagle2Drafter, Eagle2KeyCache, causal_mask, eagle2_loss
from beagle.drafter_folder import load_drafter
from beagle.model import DrafterConfig
from beagle.stages import StageSettings
from pipeline.commands.train import train as train_command
from beagle.train_config import TrainConfig
from tests.tiny_store import build_tiny_store

CFG = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=64, vocab_size=50)
FAST = dict(batch_tokens=160, lr=3e-3, warmup_steps=3, checkpoint_every=100, vocab_chunk=128, drafter="eagle2")


def _model(seed: int = 0) -> Eagle2Drafter:
    torch.manual_seed(seed)
    model = Eagle2Drafter(CFG, torch.randn(50, 32), torch.randn(50, 32))
    for p in model.parameters():  # larger weights than the init, so that every path matters
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def _batch(B: int = 2, L: int = 9, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (B, L), generator=g)
    hidden = torch.randn(B, L, 32, generator=g)
    return Batch(ids, torch.rand(B, L, generator=g) < 0.7, hidden, torch.full((B,), L))


def test_causal_mask_rows_and_key_zero():
    mask = causal_mask(4)
    assert mask.tolist() == [[False] * 4, [False, True, False, False], [False, True, True, False],
                             [False, True, True, True]]


def test_row_p_sees_tokens_up_to_p_and_states_up_to_p_minus_1():
    model, batch = _model(), _batch(B=1)
    with torch.no_grad():
        base = model.forward_sequence(batch.input_ids, batch.hidden, batch.lengths)[0]
        p = 4
        later = batch.hidden.clone()
        later[:, p:] += 5.0                       # h_p and after: invisible to rows <= p
        later_ids = batch.input_ids.clone()
        later_ids[:, p + 1:] = (later_ids[:, p + 1:] + 1) % 50
        out = model.forward_sequence(later_ids, later, batch.lengths)[0]
        assert torch.allclose(out[:p + 1], base[:p + 1], atol=1e-5)
        assert not torch.allclose(out[p + 1], base[p + 1], atol=1e-3)
        first = batch.hidden.clone()
        first[:, p - 1] += 5.0                    # h_{p-1} is fused into row p
        assert not torch.allclose(model.forward_sequence(batch.input_ids, first, batch.lengths)[0, p], base[p])


def test_padding_keys_are_invisible():
    model, batch = _model(), _batch(B=1, L=6)
    padded = collate([(batch.input_ids[0], batch.loss_mask[0], batch.hidden[0]),
                      (torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.bool), torch.zeros(9, 32))])
    with torch.no_grad():
        alone = model.forward_sequence(batch.input_ids, batch.hidden, batch.lengths)[0]
        together = model.forward_sequence(padded.input_ids, padded.hidden, padded.lengths)[0, :6]
    assert torch.allclose(alone, together, atol=1e-5)


def test_loss_is_smooth_l1_plus_a_tenth_of_soft_ce():
    model, batch = _model(), _batch()
    settings = StageSettings(window_size=1, simulation_steps=1, noise_std=0.0, regression_weight=10.0, vocab_chunk=7)
    result = eagle2_loss(model, batch, 0, settings).finish()
    hidden = model.forward_sequence(batch.input_ids, batch.hidden, batch.lengths)
    rows = torch.zeros_like(batch.loss_mask)
    rows[:, 1:-1] = batch.loss_mask[:, 2:]
    h, t = hidden[rows], batch.hidden[rows]
    ce = -(F.softmax(t @ model.lm_head.T, -1) * F.log_softmax(h @ model.lm_head.T, -1)).sum(-1).mean()
    reg = F.smooth_l1_loss(h, t, reduction="none").mean(-1).mean()
    assert torch.allclose(result.loss, 1.0 * reg + 0.1 * ce, atol=1e-5)
    assert result.count.tolist() == [int(rows.sum())]
    result.loss.backward()
    assert model.fc.weight.grad.abs().sum() > 0 and model.embed_tokens.grad is None


def test_decode_cache_and_draft_steps_match_the_teacher_forced_pass():
    """Cache built in two appends + a 2-step chain == forward_sequence with the drafted state fed back."""
    model, batch = _model(), _batch(B=1, L=10)
    ids, states = batch.input_ids[0], batch.hidden[0]
    n = 6
    with torch.no_grad():
        cache = Eagle2KeyCache(model)
        cache.append(states[:4], torch.arange(4), ids[:4])
        cache.append(states[4:n + 1], torch.arange(4, n + 1), ids[4:n + 1])
        assert len(cache) == n + 1 and cache.keys.shape[-2] == n
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
        pos = torch.tensor([[n + 1]])
        h1, k1, v1 = model.draft_step(ids[None, n + 1:n + 2], pos, cache.last_state[None, None],
                                      cache.keys, cache.values, mask)
        h2, _, _ = model.draft_step(ids[None, n + 2:n + 3], pos + 1, h1, torch.cat([cache.keys, k1], -2),
                                    torch.cat([cache.values, v1], -2), torch.ones(1, 1, 1, n + 1, dtype=torch.bool))
        fed = states[None, :n + 3].clone()
        fed[0, n + 1] = h1[0, 0]
        ref = model.forward_sequence(ids[None, :n + 3], fed, torch.tensor([n + 3]))[0]
    assert torch.allclose(h1[0, 0], ref[n + 1], atol=1e-5)
    assert torch.allclose(h2[0, 0], ref[n + 2], atol=1e-5)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_tiny_store(tmp_path_factory.mktemp("store") / "a", num_samples=16)


@pytest.mark.slow
def test_eagle2_loss_falls_and_exports_through_the_cli(store, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(train_command, [
        "--store", store, "--out", str(run), "--drafter", "eagle2", "--stage1-epochs", "16", "--stage2-epochs", "0",
        "--max-steps", "40", "--batch-tokens", "160", "--lr", "3e-3", "--warmup-steps", "3",
        "--vocab-chunk", "128", "--no-progress"])
    assert result.exit_code == 0, result.output
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 40 and sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    assert json.loads((run / "run_config.json").read_text())["config"]["drafter"] == "eagle2"
    meta = json.loads((run / "drafter" / "config.json").read_text())
    assert meta["drafter_type"] == "eagle2"
    data = StoreSet([store])
    head = data.load_head()
    loaded, _ = load_drafter(run / "drafter", embed_tokens=head["embed_tokens"], lm_head=head["lm_head"])
    assert isinstance(loaded, Eagle2Drafter)
    from beagle.checkpoint import latest_checkpoint
    from safetensors.torch import load_file
    ref = Eagle2Drafter(loaded.config, head["embed_tokens"], head["lm_head"])
    ref.load_state_dict(load_file(str(latest_checkpoint(run) / "model.safetensors")))
    batch = collate([data.sample(0, 100)])
    with torch.no_grad():
        a = ref.logits(ref.forward_sequence(batch.input_ids, batch.hidden, batch.lengths))
        b = loaded.logits(loaded.forward_sequence(batch.input_ids, batch.hidden, batch.lengths))
    assert torch.equal(a, b)


def test_unknown_drafter_is_refused():
    with pytest.raises(ValueError, match="drafter='eagle3'"):
        TrainConfig(drafter="eagle3")
    assert TrainConfig(**FAST).drafter == "eagle2"
