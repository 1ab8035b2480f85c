"""Benchmark the trainer (not a test): step time and memory of stage 1 and stage 2 at s = 1..5 on the
same batch, and the data-wait fraction of the store loader.

    python bench/train.py                      # SmolLM2-135M shapes, 2 x 512 tokens, CPU
    python bench/train.py --preset tiny        # seconds, for a smoke check
    python bench/train.py --device cuda        # bf16 autocast, allocator peak
    python bench/train.py --json p9.json       # also P9: training tokens/s in bf16 autocast ÷ fp32, same steps
                                               # on the demo's 4,096-token batches (rows of --length)

Memory: on CUDA the allocator's peak above the model; on CPU the bytes autograd keeps for backward
(bench.profiling), which is what grows with simulation steps. Random weights and states: the timing
and memory do not depend on values.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from beagle.data import Batch, Loader, StoreSet, plan_epoch  # noqa: E402
from beagle.losses import default_vocab_chunk  # noqa: E402
from beagle.model import BeagleDrafter, DrafterConfig, restrict_loss_vocabulary  # noqa: E402
from beagle.precision import cpu_has_native_bf16, keep_frozen_head_in  # noqa: E402
from beagle.stages import StageSettings, stage1_loss, stage2_loss  # noqa: E402
from beagle.train_config import TrainConfig  # noqa: E402
from beagle.trainer import build_optimizer  # noqa: E402
from bench.common import emit, record  # noqa: E402
from bench.profiling import count_saved_bytes  # noqa: E402
from pipeline.extract.state_encoding import write_store  # noqa: E402

PRESETS = {
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=300, rope_theta=10000.0, rms_norm_eps=1e-6),
}


def _settings(window_size: int, simulation_steps: int, device: torch.device = torch.device("cpu"),
              **overrides) -> StageSettings:
    """The method's defaults (noise 0.2, regression weight 10, the trainer's vocabulary chunk on `device`)."""
    return StageSettings(window_size=window_size, simulation_steps=simulation_steps, noise_std=0.2,
                         regression_weight=10.0, vocab_chunk=default_vocab_chunk(device), **overrides)


def _batch(cfg: DrafterConfig, B: int, L: int, device: torch.device) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) < 0.6
    hidden = torch.randn(B, L, cfg.hidden_size, generator=g) * 2
    return Batch(ids, mask, hidden, torch.full((B,), L)).to(device)


def _measure(model, batch, loss_fn, settings, device, autocast, repeats):
    """(median seconds per optimizer step, memory bytes)."""
    opt = build_optimizer(model, device, TrainConfig(lr=1e-5))  # as the trainer steps: its betas, decay
    times, memory = [], 0
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with count_saved_bytes(model) as saved, torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = loss_fn(model, batch, 1, settings).finish().loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            memory = torch.cuda.max_memory_allocated() - base
        else:
            memory = saved.total
        if i:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - t0)
    return statistics.median(times), memory


def _data_wait(cfg: DrafterConfig, model, device, autocast, samples: int, L: int, batch_tokens: int) -> float:
    """Write a store of random states, train one stage-1 pass over it, return the data-wait fraction."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"{tmp}/store"
        head = {"embed_tokens": model.embed_tokens.cpu(), "lm_head": model.lm_head.cpu()}
        write_store(url, ({"sample_id": str(i), "input_ids": rng.integers(0, cfg.vocab_size, L),
                           "loss_mask": np.ones(L, bool),
                           "hidden_states": torch.randn(1, L, cfg.hidden_size).to(torch.bfloat16)}
                          for i in range(samples)),
                    head=head, target={"name": "bench", "architecture": cfg.to_dict()},
                    tokenizer={"name": "none"}, capture={"layers": [-1], "dtype": "bfloat16", "max_length": L},
                    source={"name": "random"})
        data = StoreSet([url])
        settings = _settings(5, 4, device)
        opt = build_optimizer(model, device, lr=1e-5)
        waited = total = 0.0
        plan = plan_epoch(data.lengths, batch_tokens=batch_tokens, limit=L, seed=0, epoch=0)
        t_start = time.perf_counter()
        for _, batch, wait in Loader(data, plan, limit=L):
            with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                loss = stage1_loss(model, batch.to(device), 0, settings).finish().loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            waited += wait
        if device.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - t_start
    return waited / total


DEMO_BATCH_TOKENS = 4096  # the demo's `train --batch-tokens`


def precision_ratio(cfg: DrafterConfig, length: int, device: torch.device, draft_vocab: int, repeats: int,
                    json_path: str | None) -> None:
    """P9: the demo's training step (a batch of its 4,096 tokens in rows of `length`; stage 1 and stage 2
    s=4 over the draft vocabulary) timed in fp32 and in bf16 autocast with the loss head kept in bf16, as
    the trainer runs them; tokens/s ratio."""
    batch = _batch(cfg, max(1, DEMO_BATCH_TOKENS // length), length, device)
    torch.manual_seed(0)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = BeagleDrafter(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02,
                              torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(device)
        if 0 < draft_vocab < cfg.vocab_size:
            restrict_loss_vocabulary(model, torch.arange(draft_vocab))
        keep_frozen_head_in(model, dtype)
        seconds[dtype] = sum(
            _measure(model, batch, fn, _settings(5, s, device), device, dtype == torch.bfloat16, repeats)[0]
            for fn, s in ((stage1_loss, 5), (stage2_loss, 4)))
    ratio = seconds[torch.float32] / seconds[torch.bfloat16]
    tokens = batch.input_ids.numel() * 2
    native = cpu_has_native_bf16() if device.type == "cpu" else True
    emit([record("P9", "training tokens/s bf16 ÷ fp32", ratio, 2.0, ">=",
                 f"{tokens / seconds[torch.bfloat16]:.0f} vs {tokens / seconds[torch.float32]:.0f} tokens/s "
                 f"(stage 1 + stage 2 s=4); native bf16 on this {device.type}: {'yes' if native else 'no'}",
                 {"shapes": "SmolLM2-135M", "batch": f"{batch.input_ids.shape[0]} x {batch.input_ids.shape[1]}",
                  "draft_vocab": draft_vocab, "device": str(device)},
                 why="this CPU has neither AMX nor AVX512-BF16, so bf16 is emulated; the trainer keeps fp32 "
                     "here by default" if not native else "the step is not dominated by matmuls at this size")],
         json_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--window-size", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--store-samples", type=int, default=16)
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="also time stage 1 and stage 2 s=4 with the token loss over N tokens (0: skip)")
    parser.add_argument("--json", default=None, help="write the P9 record (bf16 ÷ fp32 tokens/s) here")
    parser.add_argument("--only-p9", action="store_true", help="measure P9 alone")
    args = parser.parse_args()
    device = torch.device(args.device)
    autocast = device.type == "cuda"
    torch.manual_seed(0)
    cfg = DrafterConfig.from_dict(PRESETS[args.preset])
    model = BeagleDrafter(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02,
                          torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).to(device)
    batch = _batch(cfg, args.batch, args.length, device)
    if args.only_p9:
        precision_ratio(cfg, args.length, device, args.draft_vocab, args.repeats, args.json)
        return
    k = args.window_size
    tokens = args.batch * args.length
    print(f"preset {args.preset}, batch {args.batch} x {args.length} tokens, k={k}, device {device}, "
          f"threads {torch.get_num_threads()}")
    memory_kind = "peak alloc MiB" if device.type == "cuda" else "saved-for-backward MiB"
    print(f"{'run':<34}{'step ms':>10}{'tokens/s':>11}{memory_kind:>24}")
    rows = [("stage 1", stage1_loss, _settings(k, k, device))]
    rows += [(f"stage 2 s={s}", stage2_loss, _settings(k, s, device)) for s in range(1, k + 1)]
    rows += [(f"stage 2 s={s} no recompute", stage2_loss, _settings(k, s, device, recompute=False)) for s in (1, k)]
    models = [model] * len(rows)
    if 0 < args.draft_vocab < cfg.vocab_size:
        reduced = BeagleDrafter(cfg, model.embed_tokens, model.lm_head).to(device)
        restrict_loss_vocabulary(reduced, torch.arange(args.draft_vocab))  # which tokens does not change the cost
        rows += [(f"stage 1, draft vocab {args.draft_vocab}", stage1_loss, _settings(k, k, device)),
                 (f"stage 2 s=4, draft vocab {args.draft_vocab}", stage2_loss, _settings(k, min(4, k), device))]
        models += [reduced, reduced]
    for (name, fn, settings), run_model in zip(rows, models):
        seconds, memory = _measure(run_model, batch, fn, settings, device, autocast, args.repeats)
        print(f"{name:<34}{seconds * 1e3:>10.1f}{tokens / seconds:>11.0f}{memory / 2**20:>24.1f}")
    fraction = _data_wait(cfg, model, device, autocast, args.store_samples, args.length, tokens)
    print(f"data-wait fraction (stage 1 over a {args.store_samples}-sample bf16 store): {fraction:.3f}")
    precision_ratio(cfg, args.length, device, args.draft_vocab, args.repeats, args.json)


if __name__ == "__main__":
    main()
