"""Engine export (beagle/engine_export.py, `beagle-pipeline export`): the names and shapes each layout writes, what
it refuses, and, checked against code this project did not write, that the exported EAGLE-3 folder loaded by
speculators' own Eagle3DraftModel drafts the logits our drafter drafts, over fed-back steps. The EAGLE-2 export is
checked against vLLM's llama_eagle.py graph written out below (speculators has no EAGLE-1/2 model)."""
import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from beagle.decoding.draft_vocab import ReducedVocabDrafter
from beagle.decoding.drafters import draft_backend
from beagle.eagle2 import Eagle2Drafter
from beagle.engine_export import (EAGLE3_NAMES, EngineTarget, export_eagle, export_eagle3, export_native,
                                  target_from_model_dir)
from beagle.drafter_folder import save_drafter
from beagle.model import BeagleDrafter, DrafterConfig
from beagle.state_beagle import StateBeagleDrafter
from pipeline.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
REFERENCE = ROOT / "tests" / "speculators_reference.py"
KEY_LAYERS = (0, 2, 3)       # embeddings, and the streams entering decoder layers 2 and 3
TTT_STEPS = 4                # the true-state step and 3 fed-back steps
PROMPT = 12


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A random 4-layer Llama saved as safetensors: the verifier speculators loads the embedding from."""
    directory = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=96, vocab_size=128, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def target(target_dir) -> EngineTarget:
    return target_from_model_dir(target_dir)


def _config(target: EngineTarget, **overrides) -> DrafterConfig:
    arch = LlamaConfig.from_pretrained(target.name_or_path).to_dict()
    return replace(DrafterConfig.from_architecture(arch), **overrides)


def _randomize(model: torch.nn.Module, seed: int, keep_zero: tuple[str, ...] = ()) -> torch.nn.Module:
    """Every trained tensor random (norm gains around 1), so that no block of the export hides behind an
    identity: fc, both input norms, q/k/v/o, the MLP and the output norm all matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in keep_zero:
                continue
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


def _state_drafter(target: EngineTarget, key_layers=KEY_LAYERS, seed: int = 1,
                   query_state: bool = False) -> StateBeagleDrafter:
    model = StateBeagleDrafter(_config(target, key_layers=key_layers, residual="state", query_state=query_state),
                               target.embed_tokens, target.lm_head)
    return _randomize(model, seed)


def _draft_vocab(target: EngineTarget) -> list[int]:
    """A reduced vocabulary (without the EOS id, which the export adds, as `eval` drafts)."""
    g = torch.Generator().manual_seed(5)
    return sorted(t for t in torch.randperm(target.vocab_size, generator=g)[:40].tolist() if t != 2)


def _prompt(target: EngineTarget, n_layers: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (PROMPT + 1,), generator=g)        # t_0 .. t_L
    aux = torch.randn(PROMPT, n_layers * 64, generator=g)                            # a_0 .. a_{L-1}
    return tokens, aux


# --------------------------------------------------------------------------------------------- our side

def _our_ttt_logits(drafter: torch.nn.Module, scorer, tokens: torch.Tensor, aux: torch.Tensor, steps: int):
    """Our drafter over every row r of the prompt, as speculators' forward arranges them: step k's query of
    row r is token t_{r+1+k} (0 past the end) at position r+1+k, its residual the state of row r (the true
    fused s_r at step 0, then the previous step's output), its keys the true states s_0..s_r and the outputs
    of row r's earlier steps (each keyed at its own query position). -> [steps, L, columns]."""
    L = aux.shape[0]
    rows = torch.arange(L)
    with torch.no_grad():
        states = drafter.fuse_true_states(aux)[None]                                   # [1, L, d]
        keys, values = drafter.project_keys(states, rows[None])
        visible = (rows[None, :] <= rows[:, None])                                    # true keys j <= r
        residual, out = states, []
        for step in range(steps):
            ids = torch.cat([tokens[1 + step:L + 1], tokens.new_zeros(step)])[:L]       # t_{r+1+step} or 0
            positions = (rows + 1 + step)[None]
            mask = torch.cat([visible] + [torch.eye(L, dtype=torch.bool)] * step, dim=-1)[None, None]
            hidden = drafter.forward_hidden(ids[None], positions, keys, values, mask, residual)   # [1, L, d]
            out.append(scorer(hidden)[0])
            bank_k, bank_v = drafter.project_keys(hidden, positions)
            keys, values = torch.cat([keys, bank_k], -2), torch.cat([values, bank_v], -2)
            residual = hidden
    return torch.stack(out)


def _our_chain_logits(drafter, scorer, tokens, aux, root_row: int, steps: int) -> torch.Tensor:
    """The same quantities for one row by the decoding path (StateBeagleBackend): commit positions
    0..root_row, draft a chain of `steps` tokens feeding each output back. -> [steps, columns]."""
    backend = draft_backend(drafter)
    with torch.no_grad():
        backend.append(aux[:root_row + 1], torch.arange(root_row + 1), tokens[:root_row + 1])
        parent, keys, values, out = backend.root_parent_states(), backend.keys(), backend.values(), []
        for step in range(steps):
            p = root_row + 1 + step
            mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
            hidden, bank = backend.step(tokens[None, p:p + 1], torch.tensor([[p]]), parent, keys, values, mask, True)
            out.append(scorer(hidden)[0, 0])
            keys, values = torch.cat([keys, bank[0]], -2), torch.cat([values, bank[1]], -2)
            parent = hidden
    return torch.stack(out)


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| over the largest |theirs|: the error on the scale of the logits."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


# --------------------------------------------------------------------------------------------- (a) layout

def test_eagle3_export_writes_the_speculators_names_shapes_and_config(target, tmp_path):
    model = _state_drafter(target)
    vocab = _draft_vocab(target)
    out = export_eagle3(ReducedVocabDrafter(model, torch.tensor(vocab)), target, tmp_path / "eagle3")
    weights = load_file(out / "model.safetensors")
    d, q_out, kv_out, mlp = 64, 4 * 16, 2 * 16, 96
    drafted = sorted(set(vocab) | {2})                                            # + the target's EOS
    assert {name: tuple(t.shape) for name, t in weights.items()} == {
        "fc.weight": (d, 3 * d), "layers.0.input_layernorm.weight": (d,), "layers.0.hidden_norm.weight": (d,),
        "layers.0.self_attn.q_proj.weight": (q_out, 2 * d), "layers.0.self_attn.k_proj.weight": (kv_out, 2 * d),
        "layers.0.self_attn.v_proj.weight": (kv_out, 2 * d), "layers.0.self_attn.o_proj.weight": (d, q_out),
        "layers.0.post_attention_layernorm.weight": (d,), "layers.0.mlp.gate_proj.weight": (mlp, d),
        "layers.0.mlp.up_proj.weight": (mlp, d), "layers.0.mlp.down_proj.weight": (d, mlp), "norm.weight": (d,),
        "lm_head.weight": (len(drafted), d), "d2t": (len(drafted),), "t2d": (128,), "embed_tokens.weight": (128, d)}
    assert torch.equal(weights["layers.0.self_attn.q_proj.weight"][:, d:], torch.zeros(q_out, d))   # no state in q
    assert torch.equal(weights["layers.0.self_attn.k_proj.weight"][:, :d], torch.zeros(kv_out, d))  # no emb in k, v
    assert torch.equal(weights["layers.0.self_attn.v_proj.weight"][:, d:], model.v_proj.weight)
    assert torch.equal(weights["fc.weight"], model.layer_fusion.proj.weight)
    ids = torch.arange(len(drafted)) + weights["d2t"]
    assert ids.tolist() == drafted and weights["d2t"].dtype == torch.int64
    assert weights["t2d"].dtype == torch.bool and weights["t2d"].nonzero().flatten().tolist() == drafted
    assert torch.equal(weights["lm_head.weight"], target.lm_head[ids])
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == len(drafted)
    assert config["eagle_aux_hidden_state_layer_ids"] == list(KEY_LAYERS) and config["target_hidden_size"] == d
    layer = config["transformer_layer_config"]
    assert ((layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"], layer["head_dim"])
            == ("llama", 1, 128, 16))
    spec = config["speculators_config"]
    assert spec["verifier"] == {"name_or_path": target.name_or_path, "architectures": ["LlamaForCausalLM"]}
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3 and spec["default_proposal_method"] == "greedy"
    assert torch.equal(weights["embed_tokens.weight"], target.embed_tokens)      # speculators needs it
    lean = load_file(export_eagle3(model, target, tmp_path / "lean", draft_vocab=vocab, embed_tokens=False)
                     / "model.safetensors")
    assert set(weights) - set(lean) == {"embed_tokens.weight"}                   # vLLM/SGLang share the target's
    provenance = json.loads((out / "beagle_export.json").read_text())
    assert provenance["drafter_type"] == "beagle-state" and provenance["engine_layer_ids"] == list(KEY_LAYERS)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]          # no staging folder left


def test_sglang_layout_is_the_same_weights_under_midlayer_with_sglang_layer_ids(target, tmp_path):
    model = _state_drafter(target, key_layers=(1, 2, 3))
    speculators = load_file(export_eagle3(model, target, tmp_path / "a") / "model.safetensors")
    out = export_eagle3(model, target, tmp_path / "b", layout="sglang")
    sglang = load_file(out / "model.safetensors")
    # vLLM's hf_to_vllm_mapper ({"midlayer.": "layers.0."}) and speculators' converter map it back
    assert {k.replace("midlayer.", "layers.0."): v for k, v in sglang.items()}.keys() == speculators.keys()
    assert all(torch.equal(sglang[k.replace("layers.0.", "midlayer.")], v) for k, v in speculators.items())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 128 and config["norm_before_residual"] is False
    # SGLang's id k is captured at the input of decoder layer k + 1, i.e. HF hidden_states[k + 1]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert config["num_aux_hidden_states"] == 3 and sglang["fc.weight"].shape == (64, 3 * 64)   # SGLang's fc
    layer = json.loads((tmp_path / "a" / "config.json").read_text())["transformer_layer_config"]
    assert layer["num_aux_hidden_states"] == 3    # the top-level ids of a speculators config do not size vLLM's fc
    assert "d2t" not in sglang and sglang["lm_head.weight"].shape == (128, 64)   # full vocabulary: no maps
    with pytest.raises(ValueError, match="no SGLang aux id"):
        export_eagle3(_state_drafter(target), target, tmp_path / "c", layout="sglang")   # key layer 0
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("key_layers", [(3,), (1, 3), (0, 1, 2, 3)])
def test_sglang_layout_refuses_a_drafter_without_three_aux_layers(target, tmp_path, key_layers):
    """SGLang's LlamaForCausalLMEagle3 builds fc as Linear(3 * hidden, hidden): any other count would write a
    checkpoint it cannot load. vLLM sizes fc by num_aux_hidden_states, so the speculators layout takes it."""
    model = _state_drafter(target, key_layers=key_layers)
    with pytest.raises(ValueError, match=r"exactly 3 aux layers.*--layers 1,2,3,-1 .the default.*--format eagle3"):
        export_eagle3(model, target, tmp_path / "s", layout="sglang")
    assert not (tmp_path / "s").exists()
    assert (export_eagle3(model, target, tmp_path / "v") / "model.safetensors").exists()


def test_eagle3_export_refuses_what_it_cannot_write_exactly(target, tmp_path):
    embedding_form = BeagleDrafter(_config(target), target.embed_tokens, target.lm_head)
    for export in (export_eagle3, export_eagle):
        with pytest.raises(ValueError, match="train --residual state"):
            export(embedding_form, target, tmp_path / "x")
    eagle2 = Eagle2Drafter(_config(target), target.embed_tokens, target.lm_head)
    with pytest.raises(ValueError, match="--format eagle"):
        export_eagle3(eagle2, target, tmp_path / "x")
    with pytest.raises(ValueError, match="use --format eagle3"):
        export_eagle(_state_drafter(target), target, tmp_path / "x")
    shallow = replace(target, num_hidden_layers=3)
    with pytest.raises(ValueError, match="has 3 decoder layers"):
        export_eagle3(_state_drafter(target), shallow, tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())
    export_eagle3(_state_drafter(target), target, tmp_path / "y")
    with pytest.raises(ValueError, match="exists"):
        export_eagle3(_state_drafter(target), target, tmp_path / "y")
    export_eagle3(_state_drafter(target), target, tmp_path / "y", replace=True)


def test_eagle_export_refuses_a_bias_fused_layers_and_a_draft_vocabulary(target, tmp_path):
    model = _randomize(Eagle2Drafter(_config(target), target.embed_tokens, target.lm_head), 2)   # fc.bias random
    with pytest.raises(ValueError, match="fc.bias is not zero"):
        export_eagle(model, target, tmp_path / "x")
    fused = Eagle2Drafter(_config(target, key_layers=(2, -1)), target.embed_tokens, target.lm_head)
    with pytest.raises(ValueError, match="fuses target layers"):
        export_eagle(fused, target, tmp_path / "x")
    plain = Eagle2Drafter(_config(target), target.embed_tokens, target.lm_head)
    with pytest.raises(ValueError, match="no draft vocabulary"):
        export_eagle(ReducedVocabDrafter(plain, torch.tensor(_draft_vocab(target))), target, tmp_path / "x")
    assert not list(tmp_path.iterdir())
    out = export_eagle(plain, target, tmp_path / "eagle")
    weights = load_file(out / "model.safetensors")
    assert sorted(weights) == sorted(["fc.weight", "layers.0.self_attn.q_proj.weight",
                                      "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                                      "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
                                      "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                                      "layers.0.mlp.down_proj.weight", "embed_tokens.weight"])
    # no input_layernorm (vLLM's first EAGLE layer has none), no final norm, no lm_head (the target's)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["num_hidden_layers"] == 1


def test_every_trained_tensor_of_the_state_form_has_an_engine_name(target):
    assert set(_state_drafter(target).state_dict()) == set(EAGLE3_NAMES)


# --------------------------------------------------------------------------------------------- (b) speculators

def _speculators_venv() -> Path:
    if SPECULATORS_PYTHON.is_file():
        return SPECULATORS_PYTHON
    reason = f"{SPECULATORS_PYTHON} is missing; build it with `make speculators-venv`"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the check against speculators; `make test` builds it)")
    pytest.skip(reason)


def test_a_missing_speculators_venv_skips_here_and_fails_in_ci(monkeypatch, tmp_path):
    monkeypatch.setitem(globals(), "SPECULATORS_PYTHON", tmp_path / "absent" / "python")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make speculators-venv"):
        _speculators_venv()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="make speculators-venv"):
        _speculators_venv()


@pytest.mark.slow
def test_speculators_eagle3_model_drafts_our_logits_over_fed_back_steps(target, tmp_path, capsys):
    """Two exports (a reduced draft vocabulary, and the full vocabulary without d2t/t2d of a drafter whose queries
    also read the state, `--query-state`) loaded by speculators' Eagle3DraftModel in its own venv; its TTT forward
    (true states, then 3 steps feeding its own outputs back) gives our logits. Both carry the embedding and name the verifier: speculators' loader reads the verifier's
    config.json even when the folder holds everything, and leaves a missing embedding uninitialised."""
    python = _speculators_venv()
    model = _state_drafter(target)
    vocab = sorted(set(_draft_vocab(target)) | {2})
    reduced = ReducedVocabDrafter(model, torch.tensor(vocab))
    export_eagle3(reduced, target, tmp_path / "reduced")
    queries_read_state = _state_drafter(target, seed=2, query_state=True)
    export_eagle3(queries_read_state, target, tmp_path / "full")
    assert "d2t" not in load_file(tmp_path / "full" / "model.safetensors")
    # A control the comparison must fail: the same folder read with vLLM's default for an absent flag.
    shutil.copytree(tmp_path / "reduced", tmp_path / "normed")
    config = json.loads((tmp_path / "normed" / "config.json").read_text())
    (tmp_path / "normed" / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))

    tokens, aux = _prompt(target, len(KEY_LAYERS))
    save_file({"hidden_states": aux[None].contiguous(), "input_ids": tokens[None, 1:].contiguous(),
               "ttt_steps": torch.tensor([TTT_STEPS])}, tmp_path / "inputs.safetensors")
    run = subprocess.run([str(python), str(REFERENCE), str(tmp_path / "inputs.safetensors"),
                          str(tmp_path / "theirs.safetensors"), str(tmp_path / "reduced"), str(tmp_path / "full"),
                          str(tmp_path / "normed")],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [entry["draft_vocab_size"] for entry in loaded] == [len(vocab), 128, len(vocab)]
    assert [entry["norm_before_residual"] for entry in loaded] == [False, False, True]
    assert all(entry["aux_layer_ids"] == list(KEY_LAYERS) for entry in loaded)
    theirs = load_file(tmp_path / "theirs.safetensors")

    ours_reduced = _our_ttt_logits(model, reduced.compact_logits, tokens, aux, TTT_STEPS)     # [steps, L, N]
    ours_full = _our_ttt_logits(queries_read_state, queries_read_state.logits, tokens, aux, TTT_STEPS)  # [steps, L, V]
    errors = {}
    for name, ours in (("0", ours_reduced), ("1", ours_full)):
        reference = theirs[f"{name}.logits"]
        assert reference.shape == ours.shape
        errors[name] = [_relative(ours[k], reference[k]) for k in range(TTT_STEPS)]
        assert max(errors[name]) <= 1e-4, errors
    assert _relative(ours_reduced, theirs["2.logits"]) > 1e-2          # the check sees a one-flag difference
    # The batched rows are what decoding computes: one row's chain by the decoding backend agrees.
    root = PROMPT - TTT_STEPS
    chain = _our_chain_logits(model, reduced.compact_logits, tokens, aux, root, TTT_STEPS)
    torch.testing.assert_close(chain, ours_reduced[:, root], rtol=1e-5, atol=1e-5)
    with capsys.disabled():
        print(f"\n  speculators vs ours, max relative difference per step: reduced vocab "
              f"{['%.1e' % e for e in errors['0']]}, full vocab {['%.1e' % e for e in errors['1']]}")


# --------------------------------------------------------------------------------------------- EAGLE (vLLM)

def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta):
    """Neox-style (rotate-half) RoPE, vLLM's default for Llama, on x [L, H, hd] at positions [L]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.float()[:, None] * inv
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def _vllm_eagle_logits(export_dir: Path, embed, lm_head, row_tokens, row_states) -> torch.Tensor:
    """vLLM's EagleLlamaForCausalLM (llama_eagle.py) read from the exported folder alone, over rows r carrying
    (t_{r+1}, h_r) at position r, causal: fc(cat(emb, h)) without bias, a Llama layer whose input_layernorm is
    nn.Identity, residual + MLP(post_attention_layernorm), no final norm, the target's LM head. -> [R, V]."""
    w = load_file(export_dir / "model.safetensors")
    cfg = json.loads((export_dir / "config.json").read_text())
    H, Hkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    x = torch.cat([embed[row_tokens], row_states], -1) @ w["fc.weight"].T           # [R, d]
    R, pos = x.shape[0], torch.arange(x.shape[0])
    a = "layers.0.self_attn."
    q = _rope((x @ w[a + "q_proj.weight"].T).view(R, H, hd), pos, cfg["rope_theta"]).transpose(0, 1)
    k = _rope((x @ w[a + "k_proj.weight"].T).view(R, Hkv, hd), pos, cfg["rope_theta"]).transpose(0, 1)
    v = (x @ w[a + "v_proj.weight"].T).view(R, Hkv, hd).transpose(0, 1)
    k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(R, H * hd)
    h1 = x + attn @ w[a + "o_proj.weight"].T
    m = "layers.0.mlp."
    y = _rms(h1, w["layers.0.post_attention_layernorm.weight"], eps)
    y = (F.silu(y @ w[m + "gate_proj.weight"].T) * (y @ w[m + "up_proj.weight"].T)) @ w[m + "down_proj.weight"].T
    out = h1 + y
    return out @ lm_head.T, out


def test_eagle_export_drafts_what_vllms_eagle_graph_drafts(target, tmp_path):
    """The EAGLE-2 baseline exported for vLLM's method "eagle": a prompt's true states, then 3 draft steps
    feeding each output back as the next row's state, give our logits under vLLM's graph (written above)."""
    model = _randomize(Eagle2Drafter(_config(target), target.embed_tokens, target.lm_head), 3, keep_zero=("fc.bias",))
    out = export_eagle(model, target, tmp_path / "eagle")
    g = torch.Generator().manual_seed(11)
    n = 9
    tokens = torch.randint(0, target.vocab_size, (n + TTT_STEPS,), generator=g)
    states = torch.randn(n, 64, generator=g)                                       # true h_0 .. h_{n-1}
    backend = draft_backend(model)
    with torch.no_grad():
        backend.append(states, torch.arange(n), tokens[:n])
        parent, keys, values, ours, fed = backend.root_parent_states(), backend.keys(), backend.values(), [], []
        for step in range(TTT_STEPS):
            p = n + step                                                             # query token t_p
            mask = torch.ones(1, 1, 1, keys.shape[-2], dtype=torch.bool)
            hidden, (k, v) = backend.step(tokens[None, p:p + 1], torch.tensor([[p]]), parent, keys, values, mask, True)
            ours.append(model.logits(hidden)[0, 0])
            fed.append(hidden[0, 0])
            keys, values, parent = torch.cat([keys, k], -2), torch.cat([values, v], -2), hidden
        for step in range(TTT_STEPS):
            rows = torch.cat([states, torch.stack(fed[:step])]) if step else states  # row n-1+j: j-th output
            logits, _ = _vllm_eagle_logits(out, target.embed_tokens, target.lm_head, tokens[1:n + step + 1], rows)
            assert _relative(ours[step], logits[-1]) <= 1e-4


# --------------------------------------------------------------------------------------------- CLI

def _run_dir(tmp_path: Path, model, **meta) -> Path:
    run = tmp_path / "run"
    save_drafter(run / "drafter", model, metadata={"target": {"name": "tiny", "config_sha256": None}, **meta})
    (run / "run_config.json").write_text(json.dumps({"stores": []}))
    return run


def test_cli_exports_a_run_and_refuses_with_one_line(target, target_dir, tmp_path):
    vocab = _draft_vocab(target)
    run = _run_dir(tmp_path, _state_drafter(target), draft_vocab=vocab)
    runner = CliRunner()
    result = runner.invoke(cli_main, ["export", str(run), "--format", "eagle3", "--target", str(target_dir),
                                      "--out", str(tmp_path / "e3")])
    assert result.exit_code == 0, result.output
    assert "method\": \"eagle3\"" in result.output
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["draft_vocab_size"] == len(set(vocab) | {2})                     # from the run's draft_vocab
    result = runner.invoke(cli_main, ["export", str(run / "drafter"), "--format", "native", "--out",
                                      str(tmp_path / "native")])
    assert result.exit_code == 0, result.output
    native, source = tmp_path / "native" / "model.safetensors", run / "drafter" / "model.safetensors"
    assert native.read_bytes() == source.read_bytes()
    for args, message in (
        (["--format", "eagle", "--target", str(target_dir), "--out", str(tmp_path / "x")], "use --format eagle3"),
        (["--out", str(tmp_path / "x")], "pass --target"),
        (["--target", str(target_dir), "--out", str(tmp_path / "e3")], "exists"),
    ):
        result = runner.invoke(cli_main, ["export", str(run), *args])
        assert result.exit_code == 1, result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1
    result = runner.invoke(cli_main, ["export", str(run), "--format", "eagle4", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    result = runner.invoke(cli_main, ["export", str(tmp_path), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and "holds no drafter" in result.output
    assert not (tmp_path / "x").exists()


def test_force_replaces_only_an_earlier_export_of_ours(target, target_dir, tmp_path, monkeypatch):
    """`--force` must never delete what an export did not write: an unrelated folder, a feature store, the
    training run, the drafter being exported, the current folder (which used to fail with EBUSY and leave
    `..incomplete-*` folders behind). Each is refused in one line, untouched; an earlier export is replaced."""
    from tests.tiny_store import build_tiny_store

    run = _run_dir(tmp_path, _state_drafter(target))
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "todo.txt").write_text("keep")
    store = Path(build_tiny_store(tmp_path / "store", num_samples=2))
    runner = CliRunner()

    def export(out, *args):
        return runner.invoke(cli_main, ["export", str(run), "--target", str(target_dir), "--out", str(out),
                                        "--force", *args])

    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    foreign = ("not an export of ours",)
    for out, messages in ((unrelated, foreign), (store, foreign), (run, foreign),
                          (run / "drafter", (*foreign, "is the drafter being exported"))):
        for args in ((), ("--format", "native")):
            result = export(out, *args)
            assert result.exit_code == 1 and any(m in result.output for m in messages), result.output
            assert len(result.output.strip().splitlines()) == 1
    monkeypatch.chdir(run)
    for out in (".", str(tmp_path)):
        result = export(out)
        assert result.exit_code == 1 and "the current folder" in result.output, result.output
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    assert not [path for path in tmp_path.rglob("*incomplete*")]
    for args in ((), ("--format", "native")):
        assert export(tmp_path / f"e-{len(args)}", *args).exit_code == 0
        result = export(tmp_path / f"e-{len(args)}", *args)                     # an export of ours: replaced
        assert result.exit_code == 0, result.output
    result = runner.invoke(cli_main, ["export", str(tmp_path / "e-2"), "--format", "native",
                                      "--out", str(tmp_path / "e-2"), "--force"])
    assert result.exit_code == 1 and "is the drafter being exported" in result.output, result.output


def test_damaged_or_foreign_drafter_folders_are_refused_in_one_line(target, target_dir, tmp_path):
    """A flipped header byte, a truncated weights file (which `--format native` used to copy with rc 0), an
    engine export given back as RUN, a config.json that is not an object: one line naming the file and the
    fix, never a traceback, and nothing written."""
    from beagle.drafter_folder import load_drafter

    runner = CliRunner()
    good = _run_dir(tmp_path / "good", _state_drafter(target))
    assert runner.invoke(cli_main, ["export", str(good), "--target", str(target_dir),
                                    "--out", str(tmp_path / "engine")]).exit_code == 0
    weights = (good / "drafter" / "model.safetensors").read_bytes()

    def damaged(name: str, config: str | None = None, payload: bytes | None = None) -> Path:
        run = tmp_path / name / "run"
        shutil.copytree(good, run)
        if payload is not None:
            (run / "drafter" / "model.safetensors").write_bytes(payload)
        if config is not None:
            (run / "drafter" / "config.json").write_text(config)
        return run

    flipped = bytearray(weights)
    flipped[12] ^= 0xFF                                                  # inside the JSON header
    unchecked = json.loads((good / "drafter" / "config.json").read_text())
    unchecked.pop("weights")                                             # a folder written before checksums
    cases = [(damaged("flipped", payload=bytes(flipped)), "differs from the"),   # the recorded checksum
             (damaged("truncated", payload=weights[:-100]), "bytes, its config.json records"),
             (damaged("flipped-old", json.dumps(unchecked), bytes(flipped)), "not a whole safetensors file"),
             (damaged("truncated-old", json.dumps(unchecked), weights[:-100]), "not a whole safetensors file"),
             (damaged("list", config="[1, 2]"), "holds a list"),
             (damaged("text", config="{not json"), "not valid JSON"),
             (tmp_path / "engine", "is an engine export")]
    for run, message in cases:
        for args in ((), ("--format", "native")):
            result = runner.invoke(cli_main, ["export", str(run), "--target", str(target_dir), *args,
                                              "--out", str(tmp_path / "out")])
            assert result.exit_code == 1 and message in result.output, (run, args, result.output)
            assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="is an engine export"):
        load_drafter(tmp_path / "engine", embed_tokens=target.embed_tokens, lm_head=target.lm_head)


def test_native_export_of_a_loaded_drafter_reloads(target, tmp_path):
    from beagle.drafter_folder import load_drafter

    model = _state_drafter(target)
    export_native(model, tmp_path / "native", metadata={"note": "test"})
    loaded, meta = load_drafter(tmp_path / "native", embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    assert meta["drafter_type"] == "beagle-state" and meta["note"] == "test"
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_cli_takes_the_head_and_facts_from_the_training_store_without_target(tmp_path):
    from beagle.torch_store import open_store
    from tests.tiny_store import build_tiny_store

    store = build_tiny_store(tmp_path / "store", num_samples=2, layers=(0, 1))
    head = open_store(store).load_head()
    arch = open_store(store).manifest["target"]["architecture"]
    config = DrafterConfig.from_architecture(arch)
    model = StateBeagleDrafter(replace(config, key_layers=(0, 1), residual="state"), head["embed_tokens"],
                               head["lm_head"])
    run = _run_dir(tmp_path, model, stores=[store])
    result = CliRunner().invoke(cli_main, ["export", str(run), "--out", str(tmp_path / "e3")])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert written["speculators_config"]["verifier"]["name_or_path"] is None
    assert written["transformer_layer_config"]["vocab_size"] == arch["vocab_size"]
    assert torch.equal(load_file(tmp_path / "e3" / "model.safetensors")["lm_head.weight"], head["lm_head"].float())
