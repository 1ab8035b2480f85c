"""The training loop: stage 1 epochs, then stage 2 epochs, one AdamW over both (spec §4).

Reads stores by memory map (beagle.data), never Ray, never the target model. Writes under RUN/:
run_config.json, metrics.jsonl (one line per step), checkpoints/, drafter/ (the export), curves.png.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from beagle import distributed
from beagle.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from beagle.data import Loader, StoreSet, fingerprint, plan_epoch
from beagle.eagle2 import Eagle2Drafter, eagle2_loss
from beagle.export import save_drafter
from beagle.model import BeagleDrafter, DrafterConfig, restrict_loss_vocabulary
from beagle.stages import StageSettings, stage1_loss, stage2_loss
from beagle.train_config import TrainConfig

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
# Settings a resumed run may change; everything else must match the run being continued.
_RESUMABLE_CHANGES = {"max_steps", "checkpoint_every", "device", "stage2_epochs"}


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int
    final_metrics: dict[str, Any] | None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available; use --device cpu")
    return device


def _phases(config: TrainConfig) -> list[int]:
    """The stage of each epoch, in order: [1, 1, ..., 2, 2, ...]."""
    return [1] * config.stage1_epochs + [2] * config.stage2_epochs


def _check_resume(run_dir: Path, saved: dict[str, Any], data: StoreSet, config: TrainConfig) -> TrainConfig:
    fp, old_fp = fingerprint(data.target), saved["target"]
    if fp != old_fp:
        raise ValueError(f"store target {fp} differs from the run's target {old_fp} in {run_dir / RUN_CONFIG}; "
                         "resume with the stores the run started from")
    arch, old_arch = data.target["architecture"], saved["drafter"]
    for key in ("hidden_size", "vocab_size"):
        if int(arch[key]) != int(old_arch[key]):
            raise ValueError(f"store {key}={arch[key]} differs from the run's {key}={old_arch[key]} "
                             f"({run_dir / RUN_CONFIG}); resume with the run's stores")
    old = TrainConfig.from_dict(saved["config"], source=str(run_dir / RUN_CONFIG))
    changed = {k for k, v in config.to_dict().items() if old.to_dict()[k] != v} - _RESUMABLE_CHANGES
    if changed:
        raise ValueError(f"--resume with changed settings {sorted(changed)}; a resumed run keeps the "
                         f"settings in {run_dir / RUN_CONFIG} (only {sorted(_RESUMABLE_CHANGES)} may change)")
    return config


def _draft_vocabulary(data: StoreSet, config: TrainConfig, vocab_size: int) -> torch.Tensor | None:
    """The reduced vocabulary the token loss is trained on (config.draft_vocab most frequent predicted
    tokens of the stores), or None for the full vocabulary. Exported so `eval` drafts over the same."""
    if not config.draft_vocab or config.draft_vocab >= vocab_size:
        return None
    from beagle.decoding.draft_vocab import frequent_tokens

    return frequent_tokens(data.stores, config.draft_vocab, vocab_size)


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from (they will be recomputed)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines()
             if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")


def train(stores: list[str], run_dir: str | Path, config: TrainConfig, *, resume: bool = False,
          on_step: Callable[[dict[str, Any], int], None] | None = None, draw_curves: bool = True,
          cache_dir: str | None = None, verify_store: bool = True) -> TrainResult:
    """Train a drafter on `stores` into `run_dir`. `on_step(metrics, total_steps)` is called after each
    optimizer step (the CLI drives a progress bar with it). `cache_dir` caches remote stores' files.

    Under torchrun or Ray Train every rank calls this; DDP over disjoint slices of each global batch
    (beagle.distributed), and only rank 0 writes run files and calls `on_step`."""
    with distributed.session(config.device) as ctx:
        return _train(stores, Path(run_dir), config, resume=resume, on_step=on_step if ctx.is_main else None,
                      draw_curves=draw_curves, cache_dir=cache_dir, ctx=ctx, verify_store=verify_store)


def _train(stores: list[str], run_dir: Path, config: TrainConfig, *, resume: bool,
           on_step: Callable[[dict[str, Any], int], None] | None, draw_curves: bool, cache_dir: str | None,
           ctx: distributed.DistContext, verify_store: bool = True) -> TrainResult:
    data = StoreSet(stores, cache_dir=cache_dir, verify=verify_store)
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise ValueError(f"--resume given but {run_dir}/checkpoints holds no complete checkpoint; "
                         "drop --resume to start a new run")
    if not resume and (run_dir / RUN_CONFIG).exists():
        raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
    if resume:
        config = _check_resume(run_dir, json.loads((run_dir / RUN_CONFIG).read_text()), data, config)

    distributed.barrier(ctx)  # every rank has checked run_dir before rank 0 writes into it
    device = distributed.rank_device(pick_device(config.device), ctx)
    autocast = device.type == "cuda" and config.bf16
    drafter_config = DrafterConfig.from_architecture(data.target["architecture"])
    if data.hidden_size != drafter_config.hidden_size:
        raise ValueError(f"store hidden_size {data.hidden_size} != target architecture hidden_size "
                         f"{drafter_config.hidden_size} in {data.urls[0]}")
    head = data.load_head()
    torch.manual_seed(config.seed)
    drafter_class = Eagle2Drafter if config.drafter == "eagle2" else BeagleDrafter
    model = drafter_class(drafter_config, head["embed_tokens"].float(), head["lm_head"].float()).to(device)
    draft_tokens = _draft_vocabulary(data, config, drafter_config.vocab_size)
    if draft_tokens is not None:
        restrict_loss_vocabulary(model, draft_tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                  weight_decay=config.weight_decay)
    generator = torch.Generator(device=device).manual_seed(config.seed)

    limit = config.sequence_limit
    state_rms = data.state_rms(config.rms_samples, limit)
    run_info = {
        "config": config.to_dict(), "stores": data.urls, "dataset_ids": data.dataset_ids,
        "target": fingerprint(data.target), "drafter": drafter_config.to_dict(),
        "state_rms": state_rms, "noise_std_relative": config.noise_std,
        "noise_std_absolute": config.noise_std * state_rms,
    }
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_CONFIG).write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")
    settings = StageSettings(config.window_size, config.simulation_steps, config.noise_std * state_rms,
                             config.regression_weight, config.vocab_chunk, config.detach_feedback,
                             config.stage2_recompute)

    step, phase, start_batch = 0, 0, 0
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, generator=generator)
        step, phase, start_batch = state["step"], state["position"]["epoch"], state["position"]["batch"]
        if ctx.is_main:
            _trim_metrics(run_dir / METRICS, step)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", checkpoint, step, phase, start_batch)

    phases = _phases(config)
    plans = [plan_epoch(data.lengths, batch_tokens=config.batch_tokens, limit=limit, seed=config.seed, epoch=e)
             for e in range(len(phases))]
    total = sum(len(p) for p in plans)
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    last: dict[str, Any] | None = None
    last_saved = step if checkpoint is not None else -1

    def lr_at(s: int) -> float:
        return config.lr * min(1.0, (s + 1) / config.warmup_steps) if config.warmup_steps else config.lr

    model.train()
    run_loss = distributed.loss_runner(model, ctx)
    position = {"epoch": phase, "batch": start_batch}
    metrics_cm = (run_dir / METRICS).open("a", encoding="utf-8") if ctx.is_main else contextlib.nullcontext()
    with metrics_cm as metrics_file:
        while position["epoch"] < len(phases) and step < total:
            phase = position["epoch"]
            stage = phases[phase]
            loss_fn = stage1_loss if stage == 1 else stage2_loss
            if config.drafter == "eagle2":  # one teacher-forced loss for every epoch (spec §7)
                loss_fn = eagle2_loss
            position = {"epoch": phase + 1, "batch": 0}  # where to go if this epoch has no batch left
            for batch_index, batch, wait in Loader(data, plans[phase], limit=limit, start=start_batch,
                                                   shard=(ctx.rank, ctx.world_size)):
                if step >= total:
                    position = {"epoch": phase, "batch": batch_index}
                    break
                t0 = time.perf_counter()
                batch = batch.to(device)
                offset = int(torch.randint(config.window_size, (1,), generator=generator, device=device))
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    result = run_loss(loss_fn, batch, offset, settings, generator)
                optimizer.zero_grad(set_to_none=True)
                (result.loss * ctx.world_size).backward()  # DDP averages gradients over ranks
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                optimizer.step()
                step += 1
                done = batch_index + 1 == len(plans[phase])
                position = {"epoch": phase + 1, "batch": 0} if done else {"epoch": phase, "batch": batch_index + 1}
                stats = distributed.step_stats(result, batch.tokens, ctx)  # the global batch's
                compute = time.perf_counter() - t0
                last = {
                    "step": step, "stage": stage, "epoch": phase, "loss": stats.loss,
                    "token_loss": stats.token_loss, "regression_loss": stats.regression_loss,
                    "accuracy": [c / n if n else None for c, n in zip(stats.correct, stats.count)],
                    "rows": stats.count, "tokens": stats.tokens, "lr": lr_at(step - 1),
                    "grad_norm": float(grad_norm), "tokens_per_s": stats.tokens / max(compute + wait, 1e-9),
                    "data_wait_fraction": wait / max(compute + wait, 1e-9),
                }
                if metrics_file is not None:
                    metrics_file.write(json.dumps(last) + "\n")
                    metrics_file.flush()
                if on_step is not None:
                    on_step(last, total)
                if ctx.is_main and (step % config.checkpoint_every == 0 or step == total):
                    save_checkpoint(run_dir, step=step, model=model, optimizer=optimizer, generator=generator,
                                    position=position)
                    last_saved = step
            start_batch = 0
    if not ctx.is_main:
        return TrainResult(run_dir, step, last)
    if last_saved != step:
        save_checkpoint(run_dir, step=step, model=model, optimizer=optimizer, generator=generator,
                        position=position)
    save_drafter(run_dir / "drafter", model, metadata={
        "dataset_ids": data.dataset_ids, "stores": data.urls, "target": fingerprint(data.target),
        "train_steps": step, "window_size": config.window_size, "simulation_steps": config.simulation_steps,
        **({} if draft_tokens is None else {"draft_vocab": draft_tokens.tolist()}),
    })
    if draw_curves:
        from beagle.curves import draw_curves as draw
        draw(run_dir / METRICS, run_dir / "curves.png")
    return TrainResult(run_dir, step, last)
