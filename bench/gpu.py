"""The prepared GPU check (not a test): one script, no network, ≤ 10 minutes on one GPU, whose every figure
is a rate or a ratio measured on the GPU it names.

    python bench/gpu.py              # on a machine with a CUDA GPU
    python bench/gpu.py --dry-run    # the same code path on CPU at toy sizes: prints what it would measure

It prepares what it needs: a random-weight Llama target of the chosen class saved to a temporary folder
with a small byte-level tokenizer (no download), and random token sequences as `text` records.

1. Extraction: the real `extract` (Ray, one GPU actor) over the sequences, against a bare forward of the
   same target over the same batches on the same GPU, timed after a warm-up. Rates count the actor's
   busy time (forward + shard write), not Ray start, CUDA init or model load; GB/s of states written.
2. Training: tokens/s and peak allocated memory of one optimizer step (bf16 autocast) for Beagle stage 1,
   stage 2 (s = 4) and EAGLE-2 at 1B-class and 8B-class drafter shapes, random weights and states.
1b. `extract --engine vllm` over the same sequences (when a vLLM environment is there: BEAGLE_VLLM_PYTHON):
   its tokens/s, P17 (vLLM ÷ transformers over the forward stage) and how far its bf16 states are.
3. Decoding: plain vs speculative tokens/s in bf16 on the random target with an untrained drafter (τ ≈ 1):
   the cost of drafting and verification, i.e. the τ each shape needs to break even.

Prints a dated markdown table to paste into docs/benchmarks.md. Without a GPU (and without --dry-run) it
exits with status 2 and says so.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import machine  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    """A model class: the target (and so the drafter) width, depth, heads and vocabulary."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    vocab_size: int


TARGETS = {  # Llama-3.2-1B- and Llama-3.1-8B-like; "toy" for --dry-run
    "toy": Shapes(128, 2, 2, 1, 256, 512),  # head_dim 64: one vLLM's CPU attention takes (the extract-vllm part)
    "1b": Shapes(2048, 16, 32, 8, 8192, 128256),
    "8b": Shapes(4096, 32, 32, 8, 14336, 128256),
}


@dataclass(frozen=True)
class Plan:
    """How big each measurement is: toy on a dry run, real on a GPU."""

    extract_target: str
    sequences: int
    length: int
    train_shapes: tuple[str, ...]
    train_batch: tuple[int, int]      # (rows, tokens per row)
    repeats: int
    decode_prompts: int
    decode_tokens: int


PLANS = {"dry": Plan("toy", 8, 64, ("toy",), (1, 64), 1, 1, 8),
         "gpu": Plan("1b", 256, 2048, ("1b", "8b"), (4, 2048), 5, 4, 128)}


def build_target(directory: Path, shapes: Shapes, dtype: torch.dtype) -> Path:
    """A random-weight Llama of `shapes` with a small byte-level BPE tokenizer and a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import build_tokenizer

    tokenizer = build_tokenizer(directory, template="chatml")
    config = LlamaConfig(hidden_size=shapes.hidden_size, num_hidden_layers=shapes.layers,
                         num_attention_heads=shapes.heads, num_key_value_heads=shapes.kv_heads,
                         intermediate_size=shapes.intermediate_size,
                         vocab_size=max(shapes.vocab_size, len(tokenizer)), max_position_embeddings=8192,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(directory)
    return directory


def random_texts(path: Path, sequences: int, length: int) -> Path:
    """`text` records whose byte-level tokens number about `length` each."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "token", "state", "draft", "verify"]
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": " ".join(rng.choice(words, length // 2))}) + "\n"
                            for i in range(sequences)))
    return path


def extraction_rows(work: Path, plan: Plan, device: torch.device) -> list[tuple[str, str]]:
    from pipeline.extract.forward import ForwardConfig, TargetForward, plan_batches
    from pipeline.extract.pipeline import ExtractConfig, run_extract
    from pipeline.store import open_store

    target = build_target(work / "target", TARGETS[plan.extract_target], torch.bfloat16)
    data = random_texts(work / "texts.jsonl", plan.sequences, plan.length)
    summary = run_extract(ExtractConfig(model_path=str(target), data=(str(data),), out=str(work / "store"),
                                        dtype="bfloat16", max_length=plan.length, num_workers=1,
                                        samples_per_shard=max(1, plan.sequences // 8)))
    busy = max(summary.actor_seconds, 1e-9)
    store = open_store(str(work / "store"))
    sequences = [store.get_numpy(i, decode=False)["input_ids"] for i in range(len(store))]
    forward = TargetForward(ForwardConfig(model_path=str(target), layers=(-1,), dtype="bfloat16",
                                          device=device.type))
    forward.hidden_states(sequences[:2])                                   # warm-up: kernels, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for batch in plan_batches([len(s) for s in sequences], forward.config.batch_tokens):
        forward.forward_batch([sequences[i] for i in batch])
    if device.type == "cuda":
        torch.cuda.synchronize()
    bare = summary.forward_tokens / (time.perf_counter() - started)
    rate = summary.forward_tokens / busy
    written = (summary.store_bytes - summary.head_bytes) / busy / 1e9
    shape = f"{plan.extract_target} target, {summary.forward_tokens:,} tokens, 1 actor"
    _HF_STAGE_RATE["rate"] = summary.tokens_per_second
    return [(f"extraction tokens/s, actor busy time ({shape})", f"{rate:,.0f}"),
            (f"bare forward tokens/s (same batches, same device) ({shape})", f"{bare:,.0f}"),
            ("P1 on this GPU: extraction ÷ bare forward", f"{rate / bare:.3f}"),
            ("states written, GB/s of actor busy time", f"{written:.2f}"),
            ("forward stage wall time incl. actor start and model load (s)", f"{summary.forward_seconds:.1f}")]


def extraction_vllm_rows(work: Path, plan: Plan) -> list[tuple[str, str]]:
    """`extract --engine vllm` (issue 39, P17 on a GPU) over the same sequences and target as `extraction_rows`,
    one vLLM engine in the actor's worker process: its tokens/s beside the transformers engine's, and how far
    its bf16 states are from the transformers store's (two engines' kernels round differently). Needs a vLLM
    environment on this machine (`make serve-venv` builds the CPU one; on a GPU, a venv with `pip install
    vllm`, given as BEAGLE_VLLM_PYTHON)."""
    from pipeline.extract.pipeline import ExtractConfig, run_extract
    from pipeline.jobkit.vllm_process import VllmConfig, vllm_python
    from pipeline.store import open_store

    settings = VllmConfig()  # its interpreter: $BEAGLE_VLLM_PYTHON, this one if it imports vllm, or .venv-vllm
    if not Path(vllm_python(settings)).is_file():
        return [("extract --engine vllm", f"skipped: no vLLM environment at {vllm_python(settings)} "
                                          "(set BEAGLE_VLLM_PYTHON to a venv's python with vllm installed)")]
    target, data = work / "target", work / "texts.jsonl"
    summary = run_extract(ExtractConfig(model_path=str(target), data=(str(data),), out=str(work / "store-vllm"),
                                        dtype="bfloat16", max_length=plan.length, num_workers=1,
                                        samples_per_shard=max(1, plan.sequences // 8), engine="vllm",
                                        vllm=settings))
    busy = max(summary.actor_forward_seconds, 1e-9)
    hf, vllm = open_store(str(work / "store")), open_store(str(work / "store-vllm"))
    worst, compared = 0.0, 0
    for index in range(min(len(hf), len(vllm), 16)):
        a, b = hf.get_numpy(index)["hidden_states"][0], vllm.get_numpy(index)["hidden_states"][0]  # [L, d]
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        worst, compared = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-9))), compared + 1
    shape = f"{plan.extract_target} target, {summary.forward_tokens:,} tokens, 1 actor, vLLM"
    return [(f"extract --engine vllm tokens/s, actor forward time ({shape})", f"{summary.forward_tokens / busy:,.0f}"),
            ("extract --engine vllm forward stage wall time incl. vLLM's start (s)", f"{summary.forward_seconds:.1f}"),
            ("P17 on this GPU: vLLM ÷ transformers, forward stage tokens/s",
             f"{summary.tokens_per_second / max(_HF_STAGE_RATE.get('rate', 0.0), 1e-9):.3f}"),
            (f"largest relative difference of layer -1 states, vLLM vs transformers, bf16 ({compared} samples)",
             f"{worst:.4f}")]


_HF_STAGE_RATE: dict[str, float] = {}  # extraction_rows' forward stage tokens/s, for P17


def training_rows(plan: Plan, device: torch.device) -> list[tuple[str, str]]:
    from bench.train import _batch, _measure, _settings
    from beagle.eagle2 import Eagle2Drafter, eagle2_loss
    from beagle.model import BeagleDrafter, DrafterConfig
    from beagle.precision import keep_frozen_head_in
    from beagle.stages import stage1_loss, stage2_loss

    rows = []
    B, L = plan.train_batch
    for name in plan.train_shapes:
        s = TARGETS[name]
        cfg = DrafterConfig(hidden_size=s.hidden_size, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                            head_dim=s.hidden_size // s.heads, intermediate_size=s.intermediate_size,
                            vocab_size=s.vocab_size)
        head = torch.randn(s.vocab_size, s.hidden_size) * 0.02
        batch = _batch(cfg, B, L, device)
        for label, cls, loss_fn, steps in (("Beagle stage 1", BeagleDrafter, stage1_loss, 5),
                                           ("Beagle stage 2 s=4", BeagleDrafter, stage2_loss, 4),
                                           ("EAGLE-2", Eagle2Drafter, eagle2_loss, 1)):
            model = cls(cfg, head, head).to(device)
            keep_frozen_head_in(model, torch.bfloat16)
            seconds, memory = _measure(model, batch, loss_fn, _settings(5, steps), device, True, plan.repeats)
            where = "peak allocated" if device.type == "cuda" else "kept for backward"
            rows.append((f"training tokens/s, {label}, {name} shapes, {B} × {L} tokens",
                         f"{B * L / seconds:,.0f} ({memory / 2**30:.2f} GiB {where})"))
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def decoding_rows(work: Path, plan: Plan, device: torch.device) -> list[tuple[str, str]]:
    from beagle.decoding import DraftConfig
    from beagle.decoding.evaluation import evaluate_prompts
    from beagle.decoding.loading import load_target
    from beagle.model import BeagleDrafter, DrafterConfig
    from beagle.prompts import load_prompts

    model, tokenizer = load_target(work / "target", "bfloat16", device)
    drafter = BeagleDrafter(DrafterConfig.from_architecture(model.config.to_dict()),
                            model.get_input_embeddings().weight.detach(),
                            model.get_output_embeddings().weight.detach()).to(device, torch.bfloat16).eval()
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about draft {i} and verify {i}."}) + "\n"
                               for i in range(plan.decode_prompts)))
    items = load_prompts(prompts).items
    eos: set[int] = set()  # random weights: every answer runs to the token budget, equal work on both sides
    rows = []
    for name, shape in (("chain d5", DraftConfig.chain(depth=5)), ("tree d5 k4 n16", DraftConfig(5, 4, 16))):
        summary = evaluate_prompts(model, drafter, tokenizer, items, shape, plan.decode_tokens, eos)
        rates = summary.to_json()["tokens_per_second"]
        rows.append((f"decoding bf16, {name}, untrained drafter (τ {summary.acceptance_length:.2f}): plain / "
                     "speculative tokens/s", f"{rates['baseline']:,.1f} / {rates['speculative']:,.1f} "
                     f"({summary.speedup:.2f}×)"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU at toy sizes; prints no figures to keep")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: extract, extract-vllm, train, decode")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.dry_run:
        print("bench/gpu.py: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or pass --dry-run to check the script on CPU", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cpu" if args.dry_run else "cuda")
    plan = PLANS["dry" if args.dry_run else "gpu"]
    skip = set(filter(None, args.skip.split(",")))
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (dry run: toy sizes, not figures)"
    print(f"{time.strftime('%Y-%m-%d')}, {gpu}; {machine()}")
    print("| measurement | value |\n|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = Path(tmp)
        parts = [("extract", lambda: extraction_rows(work, plan, device)),
                 ("extract-vllm", lambda: extraction_vllm_rows(work, plan)),
                 ("train", lambda: training_rows(plan, device)),
                 ("decode", lambda: decoding_rows(work, plan, device))]
        for name, run in parts:
            if name in skip or (name in ("decode", "extract-vllm") and "extract" in skip):  # they reuse its target
                continue
            started = time.perf_counter()
            for label, value in run():
                print(f"| {label} | {value} |", flush=True)
            print(f"| ({name} took {time.perf_counter() - started:.0f} s) | |", flush=True)


if __name__ == "__main__":
    main()
