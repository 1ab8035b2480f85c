"""The engine-form Beagle (`train --residual state`, docs/method.md §9): its graph is one EAGLE-3 layer, its
stage-1 residual hides the query's own window, stage 2 feeds back what drafting feeds back, and it trains,
exports and decodes exactly. The check against speculators' own EAGLE-3 model is tests/test_engine_export.py."""
import json

import pytest
import torch
import torch.nn.functional as F

from beagle.data import StoreSet, collate
from beagle.decoding import DraftConfig, plain_generate, speculative_generate
from beagle.decoding.drafters import StateBeagleBackend, draft_backend
from beagle.drafter_folder import load_drafter
from beagle.model import DrafterConfig
from beagle.registry import form_for, form_of
from beagle.stages import StageSettings, simulate, stage1_loss, window_anchor_states
from beagle.state_beagle import StateBeagleDrafter
from beagle.train_config import TrainConfig
from beagle.trainer import train
from tests.test_fused_keys import ARCH, LENGTH, _codes, _write_middle_layer_store
from tests.tiny_store import build_tiny_store, tiny_target

SHAPE = {k: v for k, v in ARCH.items() if k in DrafterConfig.__dataclass_fields__}


def _random_state_drafter(key_layers=(1,), std: float = 0.1, seed: int = 0, query_state: bool = False
                          ) -> StateBeagleDrafter:
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(ARCH["vocab_size"], ARCH["hidden_size"], generator=g), torch.randn(
        ARCH["vocab_size"], ARCH["hidden_size"], generator=g)
    model = StateBeagleDrafter(DrafterConfig(**SHAPE, key_layers=key_layers, residual="state", query_state=query_state),
                               embed, head)
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=std)
    return model.eval()


def _rope(x, pos, theta):
    """RoPE on x [L, H, hd] at integer positions [L] (rotate-half), written out for the reference."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos.float()[:, None] * inv                                       # [L, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _eagle3_reference(model: StateBeagleDrafter, row_tokens, row_states, aux: bool):
    """The EAGLE-3 layer as vLLM computes it (llama_eagle3.py, norm_before_residual false), causal over rows
    r = 0..R-1 carrying (t_{r+1}, s_r) at position r, with q/k/v of width 2d built from our weights padded
    by zero blocks. row_states [R, n*d] aux states (fc applied) when `aux`, else already-fused s_r [R, d]."""
    c, eps = model.config, model.config.rms_norm_eps
    d, H, Hkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    zq, zk = torch.zeros(H * hd, d), torch.zeros(Hkv * hd, d)
    wq = torch.cat([model.q_proj.weight, zq if model.q_state_proj is None else model.q_state_proj.weight], 1)
    wk, wv = torch.cat([zk, model.k_proj.weight], 1), torch.cat([zk, model.v_proj.weight], 1)
    h = row_states @ model.layer_fusion.proj.weight.T if aux else row_states   # [R, d]
    emb = model.embed_tokens[row_tokens]
    x = torch.cat([_rms(emb, model.input_norm.weight, eps), _rms(h, model.kv_norm.weight, eps)], -1)  # [R, 2d]
    R = x.shape[0]
    pos = torch.arange(R)
    q = _rope((x @ wq.T).view(R, H, hd), pos, c.rope_theta).transpose(0, 1)
    k = _rope((x @ wk.T).view(R, Hkv, hd), pos, c.rope_theta).transpose(0, 1).repeat_interleave(H // Hkv, 0)
    v = (x @ wv.T).view(R, Hkv, hd).transpose(0, 1).repeat_interleave(H // Hkv, 0)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(R, H * hd)
    u = h + attn @ model.o_proj.weight.T
    out = u + model.mlp(_rms(u, model.post_attention_norm.weight, eps))
    return out, _rms(out, model.output_norm.weight, eps) @ model.lm_head.T     # pre-norm output, logits


@pytest.mark.parametrize("query_state", [False, True])
def test_the_state_form_is_one_eagle3_layer_with_zero_blocks_over_fed_back_steps(query_state):
    """A prompt's true states, then three draft steps feeding each output back as the next row's state, as an
    EAGLE-3 engine drafts: our backend's logits equal the EAGLE-3 layer's (written out above) at every step.
    With `query_state` the queries also read the state (q's state block is no longer zero)."""
    model = _random_state_drafter(key_layers=(0, 1), query_state=query_state)
    n, d = 6, ARCH["hidden_size"]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, ARCH["vocab_size"], (n + 4,), generator=g)
    aux = torch.randn(n, 2 * d, generator=g)                                      # true aux states of t_0..t_{n-1}
    with torch.no_grad():
        backend = draft_backend(model)
        assert isinstance(backend, StateBeagleBackend)
        backend.append(aux, torch.arange(n), tokens[:n])
        parent, keys, values = backend.root_parent_states(), backend.keys(), backend.values()
        ours, fed = [], []
        for step in range(4):
            p = n + step                                                         # query token t_p at position p
            mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
            out, bank = backend.step(tokens[None, p:p + 1], torch.tensor([[p]]), parent, keys, values, mask, True)
            ours.append(model.logits(out)[0, 0])
            fed.append(out[0, 0])
            keys, values = torch.cat([keys, bank[0]], -2), torch.cat([values, bank[1]], -2)
            parent = out
        # The engine: rows 0..n-1 from fc(aux), then row n-1+j carries the drafter's j-th output.
        true_rows = aux @ model.layer_fusion.proj.weight.T                        # [n, d]
        for step in range(4):
            rows = torch.cat([true_rows, torch.stack(fed[:step])]) if step else true_rows
            _, logits = _eagle3_reference(model, tokens[1:n + step + 1], rows, aux=False)
            torch.testing.assert_close(ours[step], logits[-1], rtol=1e-4, atol=1e-4)


def test_stage1_rows_never_carry_a_state_of_their_own_window():
    """Changing the true states inside a window changes no row of that window (keys and residuals alike),
    while a depth-1 row's residual is exactly the previous position's state."""
    model = _random_state_drafter(key_layers=(1,))
    window, offset, L, d = 3, 1, 13, ARCH["hidden_size"]
    states = torch.randn(1, L, d)
    anchors = window_anchor_states(states, window, offset)
    assert torch.equal(anchors[0, 1], states[0, 0]) and torch.equal(anchors[0, 3], states[0, 0])  # window {1,2,3}
    assert torch.equal(anchors[0, 4], states[0, 3])
    ids = torch.randint(0, ARCH["vocab_size"], (1, L))

    def rows(s):
        batch = collate([(ids[0], torch.ones(L, dtype=torch.bool), torch.zeros(L, d), s[0])])
        settings = StageSettings(window_size=window, simulation_steps=1, noise_std=0.0, regression_weight=1.0,
                                 vocab_chunk=64)
        captured = {}
        forward = model.forward_hidden

        def keep(*args):
            captured["out"] = forward(*args)
            return captured["out"]
        model.forward_hidden = keep
        try:
            stage1_loss(model, batch, offset, settings)
        finally:
            del model.forward_hidden
        return captured["out"][0]
    base = rows(states)
    changed = states.clone()
    changed[0, 5:7] += 5.0                                                       # inside window {4, 5, 6}
    after = rows(changed)
    torch.testing.assert_close(after[4:7], base[4:7])
    assert not torch.allclose(after[7:], base[7:])                               # later windows read them


def test_stage2_feeds_back_what_drafting_feeds_back():
    """simulate's depth-j output at a position equals a drafted chain from the same context with the same
    (true) tokens: the residual and the new key of each step are the previous step's output."""
    model = _random_state_drafter(key_layers=(1,))
    L, d, window = 12, ARCH["hidden_size"], 3
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ARCH["vocab_size"], (L,), generator=g)
    aux = torch.randn(L, d, generator=g)
    batch = collate([(ids, torch.ones(L, dtype=torch.bool), torch.zeros(L, d), aux)])
    settings = StageSettings(window_size=window, simulation_steps=window, noise_std=0.0, regression_weight=1.0,
                             vocab_chunk=64, recompute=False)
    with torch.no_grad():
        offline = {}
        for step, q_pos, (hidden,) in simulate(model, batch, 0, settings):
            for row, p in enumerate(q_pos.tolist()):
                offline[p] = hidden[0, row]
        n = 5                                                                    # window {6, 7, 8}: context <= 5
        backend = draft_backend(model)
        backend.append(aux[:n + 1], torch.arange(n + 1), ids[:n + 1])
        parent, keys, values = backend.root_parent_states(), backend.keys(), backend.values()
        for j in range(1, window + 1):
            p = n + j
            mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
            out, bank = backend.step(ids[None, p:p + 1], torch.tensor([[p]]), parent, keys, values, mask, True)
            torch.testing.assert_close(out[0, 0], offline[p], rtol=1e-5, atol=1e-5)
            keys, values, parent = torch.cat([keys, bank[0]], -2), torch.cat([values, bank[1]], -2), out


def test_state_form_learns_to_read_a_middle_layer(tmp_path):
    """The synthetic task of tests/test_fused_keys.py: the next token is readable only from layer 1's
    residual stream; a state-residual drafter keyed on layer 1 alone learns it (held out)."""
    codes = _codes()
    train_store = StoreSet([_write_middle_layer_store(tmp_path / "train", codes, 256, seed=1)], aux_keys=True)
    held_out = StoreSet([_write_middle_layer_store(tmp_path / "test", codes, 32, seed=2)], key_layers=(1,))
    assert train_store.key_layers == (1,)
    torch.manual_seed(0)
    head = train_store.load_head()
    model = StateBeagleDrafter(DrafterConfig(**SHAPE, key_layers=(1,), residual="state"), head["embed_tokens"],
                               head["lm_head"])
    depth1 = StageSettings(window_size=1, simulation_steps=1, noise_std=0.0, regression_weight=10.0, vocab_chunk=8192)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        rows = torch.randint(0, len(train_store), (16,), generator=g).tolist()
        result = stage1_loss(model, collate([train_store.sample(i, LENGTH) for i in rows]), 0, depth1).finish()
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    with torch.no_grad():
        result = stage1_loss(model.eval(), collate([held_out.sample(i, LENGTH) for i in range(len(held_out))]), 0,
                             depth1).finish()
    accuracy = float(result.correct[0]) / float(result.count[0])
    assert accuracy >= 0.9, f"state-residual drafter depth-1 top-1 {accuracy:.3f} on held-out samples"


FAST = dict(batch_tokens=160, lr=3e-3, warmup_steps=3, window_size=3, simulation_steps=2, checkpoint_every=100,
            vocab_chunk=128, stage1_epochs=1, stage2_epochs=1, max_steps=6, bf16=False, residual="state")


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_state_form_trains_exports_and_decodes_exactly(tmp_path, draft_vocab):
    """Layers (1, -1) captured from a real tiny target: train both stages with --residual state -> export ->
    greedy decoding equals plain decoding, chain and tree, over the full or a reduced draft vocabulary."""
    store = build_tiny_store(tmp_path / "store", num_samples=12, layers=(1, -1))
    run = tmp_path / "run"
    train([store], run, TrainConfig(**FAST, draft_vocab=draft_vocab))
    meta = json.loads((run / "drafter" / "config.json").read_text())
    assert (meta["drafter_type"], meta["residual"], meta["key_layers"]) == ("beagle-state", "state", [1])
    target = tiny_target(0)
    drafter, _ = load_drafter(run / "drafter", embed_tokens=target.get_input_embeddings().weight,
                              lm_head=target.get_output_embeddings().weight)
    assert form_of(drafter) is form_for("beagle", "state")
    prompt = torch.tensor([3, 7, 11, 12, 14])
    plain = plain_generate(target, prompt, 20, set()).tokens
    for shape in (DraftConfig.chain(depth=3), DraftConfig(depth=3, top_k=3, total_tokens=8)):
        assert speculative_generate(target, drafter, prompt, 20, set(), shape).tokens == plain


def test_state_form_settings_are_checked_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="not -1"):
        DrafterConfig(**SHAPE, key_layers=(1, -1), residual="state")
    with pytest.raises(ValueError, match="ascending"):
        DrafterConfig(**SHAPE, key_layers=(1, 0), residual="state")
    with pytest.raises(ValueError, match="--drafter eagle2 takes --residual embedding"):
        TrainConfig(drafter="eagle2", residual="state")
    with pytest.raises(ValueError, match="--key-layers .* does not apply to drafter form beagle; it is for "
                                         "`--drafter beagle --residual state`"):
        TrainConfig(key_layers=(1,))
    with pytest.raises(ValueError, match="--fuse-layers .* does not apply to drafter form beagle-state"):
        TrainConfig(residual="state", fuse_layers=True)
    with pytest.raises(ValueError, match="--query-state .* does not apply to drafter form eagle2"):
        TrainConfig(drafter="eagle2", query_state=True)
    last_only = build_tiny_store(tmp_path / "last", num_samples=4)
    with pytest.raises(ValueError, match=r"residual stream entering decoder layers.*--layers"):
        StoreSet([last_only], aux_keys=True)


def test_every_form_is_trained_by_its_own_flags_and_its_class_agrees_with_its_row():
    """`train --drafter/--residual` select each form of the one registry, and what a row declares of its
    class (drafter_type, residual, carries_state) is what the class says."""
    from beagle.registry import FORMS, RESIDUALS, resolve, train_drafters

    assert {form_for(*form.train_as).name for form in FORMS.values()} == set(FORMS)
    assert set(train_drafters()) == {"beagle", "eagle2"} and set(RESIDUALS) == {"embedding", "state"}
    for form in FORMS.values():
        cls = resolve(form.model)
        assert (cls.drafter_type, cls.carries_state, cls.draft_columns) == (form.name, form.carries_state, None)
        assert form.train_as[1] == form.residual and set(form.exports) >= {"native"}
