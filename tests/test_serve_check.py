"""A real engine serves a drafter in our export format: vLLM (CPU build), plain vs EAGLE-3, end to end.

Runs bench/serve.py on a RANDOM EAGLE-3 drafter (speculators format, built by bench/serve.py) for the demo
target at a tiny size (2 prompts x 16 tokens, float32 only; about 3 minutes on 2 cores). What it proves:
vLLM loads the config and every weight (a misnamed or misshapen tensor fails the load), drafts with it,
reports its speculative-decoding counters, and greedy speculative decoding reproduces plain decoding token
for token in float32. A random drafter's acceptance is ~0, so no acceptance figure is asserted here.

Skipped unless the vLLM venv exists (`make serve-venv`) and the demo target is prepared (`make demo-cache`).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DEMO = ROOT / ".cache" / "demo"


def _serve_module():
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_drafter_layout(tmp_path):
    """The hand-built drafter has the tensor names and shapes vLLM's llama_eagle3 loader expects (fast)."""
    import torch
    from safetensors.torch import load_file

    serve = _serve_module()
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 320,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}))
    out = serve.build_random_eagle3_drafter(target, tmp_path / "drafter", draft_vocab_size=100)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3]  # (2, L//2, L-3) for L=6, deduplicated, sorted
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 2
    weights = load_file(str(out / "model.safetensors"))
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (64, 128)
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (32, 128)
    assert weights["fc.weight"].shape == (64, 2 * 64)
    assert weights["lm_head.weight"].shape == (100, 64)
    d2t, t2d = weights["d2t"], weights["t2d"]
    target_ids = d2t + torch.arange(100)
    assert t2d.sum() == 100 and bool(t2d[target_ids].all()) and bool((target_ids[1:] > target_ids[:-1]).all())


@pytest.mark.slow
def test_vllm_serves_random_eagle3_drafter(tmp_path):
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"{VLLM_PYTHON} missing: run `make serve-venv` (vLLM CPU build in its own venv)")
    if not (DEMO / "model" / "config.json").is_file():
        pytest.skip(f"demo target missing at {DEMO}: run `make demo-cache`")
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve.py"), "--random-drafter", str(tmp_path / "drafter"),
         "--limit", "2", "--max-new-tokens", "16", "--dtypes", "float32", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    row = report["dtypes"]["float32"]
    assert row["total"] == 2 and row["identical"] == 2, row  # greedy speculative == plain, in float32
    metrics = row["spec_metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"] == 3 * metrics["vllm:spec_decode_num_drafts"]
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == 3
    assert row["acceptance_length"] >= 1.0 and len(row["per_position_acceptance"]) == 3
    assert row["plain_output_tokens"] == row["spec_output_tokens"] > 0
    assert row["plain_tokens_per_second"] > 0 and row["spec_tokens_per_second"] > 0
