"""Stage 1 and stage 2 forward passes on a tiny real store: visibility, memory, recompute parity."""
import pytest
import torch

from beagle.data import StoreSet, collate
from beagle.masks import depth_positions
from beagle.model import BeagleDrafter, DrafterConfig
from beagle.stages import StageSettings, simulate, stage1_loss, stage2_loss
from bench.profiling import count_saved_bytes
from tests.tiny_store import build_tiny_store


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return StoreSet([build_tiny_store(tmp_path_factory.mktemp("s") / "store", num_samples=6,
                                      min_len=30, max_len=40)])


def _model(data, seed=0):
    torch.manual_seed(seed)
    head = data.load_head()
    return BeagleDrafter(DrafterConfig.from_architecture(data.target["architecture"]),
                         head["embed_tokens"], head["lm_head"])


def _batch(data, n=4):
    return collate([data.sample(i, 1000) for i in range(n)])


@pytest.mark.parametrize("offset", [0, 2])
def test_stage2_query_sees_true_context_and_its_windows_predictions_only(data, offset):
    """Depth-j query p (window context n) must depend on true states <= n and on the tokens at
    n+1..p (which produce its predicted keys and its own query), and on nothing else."""
    k, s = 5, 4
    model = _model(data).eval()
    settings = StageSettings(window_size=k, simulation_steps=s,
                             noise_std=0.0, regression_weight=10.0, vocab_chunk=128, recompute=False)
    batch = _batch(data, 1)
    L = int(batch.lengths[0])
    base = {j: (q, h) for j, q, (h,) in simulate(model, batch, offset, settings)}
    j = 3
    q_pos, hidden = base[j]
    p = int(q_pos[3])                       # a depth-3 query well inside the sequence
    n = p - j                               # last true position it may see
    row = hidden[0, 3]

    def run(mutate):
        b = collate([(batch.input_ids[0].clone(), batch.loss_mask[0], batch.hidden[0].clone())])
        mutate(b)
        return {jj: h for jj, _, (h,) in simulate(model, b, offset, settings)}[j][0, 3]

    def set_hidden(positions):
        def f(b):
            b.hidden[0, positions] += 5.0
        return f

    def set_ids(positions):
        def f(b):
            b.input_ids[0, positions] = (b.input_ids[0, positions] + 7) % 300
        return f

    # Unseen: true states at n+1.. (its own window and later), tokens after p.
    assert torch.equal(run(set_hidden(list(range(n + 1, L)))), row)
    assert torch.equal(run(set_ids(list(range(p + 1, L)))), row)
    # Seen: the true state at n, the tokens at n+1 and n+2 (predicted keys), its own token.
    for mutate in (set_hidden([n]), set_hidden([0]), set_ids([n + 1]), set_ids([n + 2]), set_ids([p])):
        assert not torch.allclose(run(mutate), row)


def test_stage2_depth1_equals_stage1_rows(data):
    model = _model(data).eval()
    batch = _batch(data)
    settings = StageSettings(window_size=5, simulation_steps=1,
                             noise_std=0.0, regression_weight=10.0, vocab_chunk=128, recompute=False)
    s1 = stage1_loss(model, batch, 1, StageSettings(window_size=5, simulation_steps=5,
                                                    noise_std=0.0, regression_weight=10.0, vocab_chunk=128)).finish()
    steps = simulate(model, batch, 1, settings)
    assert steps[0][0] == 1 and steps[0][1].tolist() == depth_positions(40, 5, 1, 1).tolist()[:steps[0][1].numel()]
    assert s1.count[0] == stage2_loss(model, batch, 1, settings).finish().count[0]


def test_recompute_gives_the_same_loss_and_gradients(data):
    batch = _batch(data)
    grads = []
    for recompute in (False, True):
        model = _model(data)
        settings = StageSettings(window_size=5, simulation_steps=4,
                                 noise_std=0.1, regression_weight=10.0, vocab_chunk=128, recompute=recompute)
        loss = stage2_loss(model, batch, 3, settings, torch.Generator().manual_seed(0)).finish().loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_stage2_memory_is_flat_in_simulation_steps(data):
    """With per-step recompute and in-block losses, the only bytes kept for backward that grow with s
    are the predicted-key bank (one step's keys and values, bounded by L slots in all, docs/method.md §3):
    nothing per trained row. Without recompute they grow with every step (the check can fail)."""
    batch = _batch(data, 6)
    model = _model(data)
    cfg = model.config

    def saved(steps, recompute):
        with count_saved_bytes(model) as counter:
            stage2_loss(model, batch, 0, StageSettings(window_size=5, simulation_steps=steps,
                                                       noise_std=0.1, regression_weight=10.0, vocab_chunk=128, recompute=recompute))
        return counter.total

    flat = [saved(s, True) for s in range(1, 5)]
    grows = [saved(s, False) for s in range(1, 5)]
    B, L = batch.input_ids.shape
    bank_step = B * 2 * cfg.num_key_value_heads * depth_positions(L, 5, 0, 1).numel() * cfg.head_dim * 4  # fp32 k+v
    assert [b - flat[0] for b in flat] == [s * bank_step for s in range(4)], flat
    assert max(flat) <= 1.2 * flat[0], flat
    assert grows[3] >= 2.5 * grows[0], grows
    with count_saved_bytes(model) as counter:
        stage1_loss(model, batch, 0, StageSettings(window_size=5, simulation_steps=4,
                                                   noise_std=0.1, regression_weight=10.0, vocab_chunk=128))
    assert max(flat) < counter.total
