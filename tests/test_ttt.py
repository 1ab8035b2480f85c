"""The EAGLE-3 style training-time-test loop: its masks, its loss, and its memory growing with steps
while Beagle's stage 2 stays flat (P4)."""
import pytest
import torch

from beagle.data import Batch, StoreSet, collate
from beagle.model import BeagleDrafter, DrafterConfig
from beagle.stages import StageSettings, stage2_loss
from bench.profiling import count_saved_bytes
from bench.ttt import ttt_forward, ttt_loss, ttt_mask
from tests.tiny_store import build_tiny_store

CFG = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=64, vocab_size=50)


def _model(seed: int = 0) -> BeagleDrafter:
    torch.manual_seed(seed)
    model = BeagleDrafter(CFG, torch.randn(50, 32), torch.randn(50, 32))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def _batch(B: int, L: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, 50, (B, L), generator=g), torch.ones(B, L, dtype=torch.bool),
                 torch.randn(B, L, 32, generator=g), torch.full((B,), L))


def test_mask_step_1_is_strictly_causal_and_later_steps_add_one_diagonal_per_bank():
    assert torch.equal(ttt_mask(5, 1), torch.ones(5, 5).tril(-1).bool())
    m = ttt_mask(6, 3)                                    # [6, 18]: true, bank 1, bank 2
    p = 5
    assert m[p, :6].nonzero().flatten().tolist() == [0, 1, 2]      # true context n = p - 3
    assert m[p, 6:12].nonzero().flatten().tolist() == [3]           # depth-1 prediction of the root
    assert m[p, 12:].nonzero().flatten().tolist() == [4]            # depth-2 prediction of the root


def test_step_j_query_depends_on_true_context_and_its_own_root_only():
    model, batch = _model().eval(), _batch(1, 10)
    settings = StageSettings(window_size=1, simulation_steps=3, noise_std=0.0, regression_weight=10.0, vocab_chunk=64)
    with torch.no_grad():
        base = ttt_forward(model, batch, settings)[2][0]          # step 3
        p = 8
        moved = batch.hidden.clone()
        moved[:, p - 2:] += 3.0                                    # beyond the root's context p - 3
        ids = batch.input_ids.clone()
        ids[:, p + 1:] = (ids[:, p + 1:] + 1) % 50
        out = ttt_forward(model, Batch(ids, batch.loss_mask, moved, batch.lengths), settings)[2][0]
        assert torch.allclose(out[p], base[p], atol=1e-5)
        context = batch.hidden.clone()
        context[:, p - 3] += 3.0
        assert not torch.allclose(ttt_forward(model, Batch(batch.input_ids, batch.loss_mask, context,
                                                           batch.lengths), settings)[2][0, p], base[p], atol=1e-4)
        root_token = batch.input_ids.clone()
        root_token[:, p - 2] = (root_token[:, p - 2] + 1) % 50    # first drafted token of the root
        assert not torch.allclose(ttt_forward(model, Batch(root_token, batch.loss_mask, batch.hidden,
                                                           batch.lengths), settings)[2][0, p], base[p], atol=1e-4)


def test_ttt_memory_grows_with_steps_while_stage2_stays_flat():
    model, batch = _model(), _batch(2, 96)

    def saved(loss_fn, steps):
        with count_saved_bytes(model) as counter:
            loss_fn(model, batch, 0, StageSettings(window_size=5, simulation_steps=steps,
                                                   noise_std=0.1, regression_weight=10.0, vocab_chunk=64))
        return counter.total

    ttt = [saved(ttt_loss, s) for s in (1, 2, 4)]
    beagle = [saved(stage2_loss, s) for s in (1, 2, 4)]
    assert ttt[1] > 1.6 * ttt[0] and ttt[2] > 3.0 * ttt[0], ttt
    # Stage 2 keeps the shared true bank once; what grows is only the rows it trains (1/k of L per step:
    # loss rows and fed-back keys), so s=4 stays near 1.5x of s=1 while TTT's grows with s * L.
    assert max(beagle) <= 1.6 * beagle[0], beagle
    assert beagle[2] / beagle[0] < 0.5 * ttt[2] / ttt[0] and beagle[2] < ttt[2] / 2, (beagle, ttt)


@pytest.mark.slow
def test_ttt_loss_falls_on_a_tiny_store(tmp_path):
    data = StoreSet([build_tiny_store(tmp_path / "s", num_samples=8, min_len=20, max_len=30)])
    head = data.load_head()
    torch.manual_seed(0)
    model = BeagleDrafter(DrafterConfig.from_architecture(data.target["architecture"]),
                          head["embed_tokens"], head["lm_head"])
    batch = collate([data.sample(i, 100) for i in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = StageSettings(window_size=3, simulation_steps=3, noise_std=0.0, regression_weight=10.0, vocab_chunk=128)
    losses = []
    for _ in range(30):
        result = ttt_loss(model, batch, 0, settings).finish()
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        losses.append(result.loss.item())
        assert all(n > 0 for n in result.count)
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3]), losses
