"""The training loop: stage 1 epochs, then stage 2 epochs, one AdamW over both (docs/method.md).

Reads stores by memory map (beagle.data), never Ray, never the target model. Writes under RUN/:
run_config.json, metrics.jsonl (one line per step, and one per validation: `"split": "val"`), checkpoints/,
drafter/ (the export), curves.png. With `grad_accum` G each step's batch is split into G micro-batches whose
gradients add up to the whole batch's; with `val_samples`/`val_store` held-out samples are evaluated every
`eval_every` steps (beagle/validation.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from beagle import distributed
from beagle.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from beagle.data import Batch, Loader, StoreSet, fingerprint, plan_epoch
from beagle.devices import pick_device
from beagle.errors import RunStateError
from beagle.host_allocator import loaded_allocator
from beagle.drafter_folder import save_drafter
from beagle.losses import LossResult, LossSums
from beagle.model import DrafterConfig, restrict_loss_vocabulary
from beagle.precision import autocast, keep_frozen_head_in, training_dtype
from beagle.registry import form_for
from beagle.stages import StageSettings
from beagle.target_init import init_from_target
from beagle.train_config import TrainConfig
from beagle.validation import ValidationSet, evaluate, metrics_record, open_validation

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
# Settings a resumed run may change; everything else must match the run being continued.
# bf16 may change: master weights and optimizer state are fp32 either way. eval_every only changes when the
# held-out samples are scored; a moved copy of the validation store is checked by its dataset_id instead.
_RESUMABLE_CHANGES = {"max_steps", "checkpoint_every", "device", "stage2_epochs", "bf16", "eval_every"}


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    steps: int
    final_metrics: dict[str, Any] | None
    validation: dict[str, Any] | None = None  # the last validation's metrics line, when the run validates


def _phases(config: TrainConfig) -> list[int]:
    """The stage of each epoch, in order: [1, 1, ..., 2, 2, ...]."""
    return [1] * config.stage1_epochs + [2] * config.stage2_epochs


def _check_resume(run_dir: Path, saved: dict[str, Any], data: StoreSet, config: TrainConfig) -> TrainConfig:
    fp, old_fp = fingerprint(data.target), saved["target"]
    if fp != old_fp:
        raise RunStateError(f"store target {fp} differs from the run's target {old_fp} in {run_dir / RUN_CONFIG}; "
                         "resume with the stores the run started from")
    if data.dataset_ids != saved.get("dataset_ids", data.dataset_ids):
        # Another store of the same target would continue the batch plan over other samples, and the run's
        # record would name only the new store, dropping what the steps so far trained on.
        raise RunStateError(f"--resume with stores {data.urls} (dataset_ids {[i[:12] for i in data.dataset_ids]}), but "
                         f"the run in {run_dir} trained on {saved.get('stores')} (dataset_ids "
                         f"{[str(i)[:12] for i in saved['dataset_ids']]}); resume with the same --store list, in "
                         "the same order (moved copies are fine), or start a new run in another --out")
    arch, old_arch = data.target["architecture"], saved["drafter"]
    for key in ("hidden_size", "vocab_size"):
        if int(arch[key]) != int(old_arch[key]):
            raise RunStateError(f"store {key}={arch[key]} differs from the run's {key}={old_arch[key]} "
                             f"({run_dir / RUN_CONFIG}); resume with the run's stores")
    old = TrainConfig.from_dict(saved["config"], source=str(run_dir / RUN_CONFIG))
    changed = {k for k, v in config.to_dict().items() if old.to_dict()[k] != v} - _RESUMABLE_CHANGES
    if old.val_store is not None and config.val_store is not None:
        changed.discard("val_store")  # the same store elsewhere is fine: _check_validation compares dataset_ids
    if changed:
        raise RunStateError(f"--resume with changed settings {sorted(changed)}; a resumed run keeps the "
                         f"settings in {run_dir / RUN_CONFIG} (only {sorted(_RESUMABLE_CHANGES)} may change)")
    return config


def _check_validation(run_dir: Path, saved: dict[str, Any], val: ValidationSet | None) -> None:
    """A resumed run validates on the samples it validated on (the split is recomputed from the seed; this
    catches a store whose samples changed under the same settings)."""
    before, now = saved.get("validation"), None if val is None else val.record()
    if before is None and now is None:
        return
    if before is None or now is None or before["dataset_ids"] != now["dataset_ids"] or \
            before["indices"] != now["indices"]:
        raise RunStateError(f"--resume would validate on other samples than the run in {run_dir} did "
                         f"({RUN_CONFIG}: {None if before is None else before['stores']}); resume with the same "
                         "stores, --val-samples and --val-store, or start a new run in another --out")


def _draft_vocabulary(data: StoreSet, config: TrainConfig, vocab_size: int,
                      held_out: list[int] | None = None) -> torch.Tensor | None:
    """The reduced vocabulary the token loss is trained on (config.draft_vocab most frequent predicted
    tokens of the stores' training samples), or None for the full vocabulary. Exported so `eval` drafts
    over the same."""
    if not config.draft_vocab or config.draft_vocab >= vocab_size:
        return None
    from beagle.decoding.draft_vocab import frequent_tokens

    exclude = data.per_store(held_out) if held_out else None
    return frequent_tokens(data.stores, config.draft_vocab, vocab_size, exclude=exclude)


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from (they will be recomputed)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines()
             if ln.strip() and json.loads(ln)["step"] <= last_step]  # validations at the checkpoint's step stay
    path.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")


def train(stores: list[str], run_dir: str | Path, config: TrainConfig, *, resume: bool = False,
          on_step: Callable[[dict[str, Any], int], None] | None = None,
          on_finish: Callable[[Path], None] | None = None,
          cache_dir: str | None = None, verify_store: bool = True) -> TrainResult:
    """Train a drafter on `stores` into `run_dir`. `on_step(metrics, total_steps)` is called after each
    optimizer step (the CLI drives a progress bar with it), `on_finish(run_dir)` once the drafter is
    exported (the CLI draws the curves with it: the library draws nothing). `cache_dir` caches remote
    stores' files.

    Under torchrun or Ray Train every rank calls this; DDP over disjoint slices of each global batch
    (beagle.distributed), and only rank 0 writes run files and calls `on_step`."""
    with distributed.session(config.device) as ctx:
        run = _start_run(stores, Path(run_dir), config, resume=resume, cache_dir=cache_dir, ctx=ctx,
                         verify_store=verify_store)
        position = _train_epochs(run, on_step if ctx.is_main else None)
        if ctx.is_main:
            _finish_run(run, position)
            if on_finish is not None:
                on_finish(run.run_dir)
        return TrainResult(run.run_dir, run.step, run.last_metrics, run.last_validation)


@dataclass
class _Run:
    """Everything one training run holds between its named steps."""

    run_dir: Path
    config: TrainConfig
    ctx: distributed.DistContext
    data: StoreSet
    device: torch.device
    dtype: torch.dtype                  # autocast dtype of the steps (fp32: autocast off)
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    settings: StageSettings
    draft_tokens: torch.Tensor | None
    plans: list[list]                   # batch plan of each epoch
    total_steps: int
    val: ValidationSet | None = None    # held-out samples, when the run validates
    step: int = 0
    start: tuple[int, int] = (0, 0)     # (epoch, batch) to continue from
    last_saved: int = -1
    last_metrics: dict[str, Any] | None = None
    last_validation: dict[str, Any] | None = None


def _start_run(stores: list[str], run_dir: Path, config: TrainConfig, *, resume: bool, cache_dir: str | None,
               ctx: distributed.DistContext, verify_store: bool) -> _Run:
    """Open the stores, check or create the run directory, build the drafter and its optimizer, and
    restore the latest checkpoint when resuming."""
    data = StoreSet(stores, cache_dir=cache_dir, verify=verify_store, fuse_layers=config.fuse_layers,
                    key_layers=config.key_layers, aux_keys=form_for(config.drafter, config.residual).keys == "aux",
                    verify_share=(ctx.rank, ctx.world_size))
    checkpoint = latest_checkpoint(run_dir) if resume else None
    config = _check_run_dir(run_dir, config.for_world_size(ctx.world_size), data, resume=resume,
                            checkpoint=checkpoint)
    train_indices, val = open_validation(data, config, world_size=ctx.world_size, rank=ctx.rank,
                                         cache_dir=cache_dir, verify=verify_store)
    if resume:
        _check_validation(run_dir, json.loads((run_dir / RUN_CONFIG).read_text()), val)
    distributed.barrier(ctx)  # every rank has checked run_dir before rank 0 writes into it
    device = distributed.rank_device(pick_device(config.device), ctx)
    dtype = training_dtype(device, config.bf16)
    held_out = val.indices if val is not None and train_indices is not None else None
    model, drafter_config, draft_tokens = _build_drafter(data, config, device, dtype, held_out)
    optimizer = build_optimizer(model, device, config)
    state_rms = data.state_rms(config.rms_samples, config.sequence_limit, indices=train_indices)
    if ctx.is_main:
        _write_run_config(run_dir, config, data, drafter_config, state_rms, dtype, val)
    plans = _plans(data, config, train_indices, ctx.world_size)
    total = sum(len(p) for p in plans)
    run = _Run(run_dir, config, ctx, data, device, dtype, model, optimizer,
               torch.Generator(device=device).manual_seed(config.seed),
               StageSettings.from_config(config, state_rms, device),
               draft_tokens, plans, total if config.max_steps is None else min(total, config.max_steps), val)
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, generator=run.generator)
        run.step = run.last_saved = state["step"]
        run.start = (state["position"]["epoch"], state["position"]["batch"])
        if ctx.is_main:
            _trim_metrics(run_dir / METRICS, run.step)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", checkpoint, run.step, *run.start)
    return run


def _plans(data: StoreSet, config: TrainConfig, train_indices: np.ndarray | None, world_size: int) -> list[list]:
    """The batch plan of every epoch over the training samples (all of them, or all but the held-out
    ones). Every batch has a row for each rank's each micro-batch."""
    lengths = data.lengths if train_indices is None else data.lengths[train_indices]
    plans = [plan_epoch(lengths, batch_tokens=config.batch_tokens, limit=config.sequence_limit, seed=config.seed,
                        epoch=e, min_rows=max(config.min_batch_rows, world_size * config.grad_accum))
             for e in range(len(_phases(config)))]
    if train_indices is None:
        return plans
    return [[[int(train_indices[i]) for i in batch] for batch in plan] for plan in plans]


def _check_run_dir(run_dir: Path, config: TrainConfig, data: StoreSet, *, resume: bool,
                   checkpoint: Path | None) -> TrainConfig:
    if resume and checkpoint is None:
        raise RunStateError(f"--resume given but {run_dir}/checkpoints holds no complete checkpoint; "
                         "drop --resume to start a new run")
    if not resume and (run_dir / RUN_CONFIG).exists():
        raise RunStateError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
    if resume:
        return _check_resume(run_dir, json.loads((run_dir / RUN_CONFIG).read_text()), data, config)
    return config


def _build_drafter(data: StoreSet, config: TrainConfig, device: torch.device, dtype: torch.dtype,
                   held_out: list[int] | None = None) -> tuple[torch.nn.Module, DrafterConfig, torch.Tensor | None]:
    """The drafter on `device` with the target's frozen head, seeded; its loss head is restricted to
    the draft vocabulary when one is asked for, and kept once in the training dtype."""
    drafter_config = replace(DrafterConfig.from_architecture(data.target["architecture"]), key_layers=data.key_layers,
                             residual=config.residual, query_state=config.query_state)
    if data.hidden_size != drafter_config.hidden_size:
        raise ValueError(f"store hidden_size {data.hidden_size} != target architecture hidden_size "
                         f"{drafter_config.hidden_size} in {data.urls[0]}")
    head = data.load_head()
    torch.manual_seed(config.seed)
    form = form_for(config.drafter, config.residual)
    model = form.build(drafter_config, head["embed_tokens"].float(), head["lm_head"].float())
    if config.init_from_target is not None:
        init_from_target(model, config.init_from_target, config.init_layer, store_target=data.target)
    model = model.to(device)
    draft_tokens = _draft_vocabulary(data, config, drafter_config.vocab_size, held_out)
    if draft_tokens is not None:
        restrict_loss_vocabulary(model, draft_tokens)
    keep_frozen_head_in(model, dtype)
    return model, drafter_config, draft_tokens


def _write_run_config(run_dir: Path, config: TrainConfig, data: StoreSet, drafter_config: DrafterConfig,
                      state_rms: float, dtype: torch.dtype, val: ValidationSet | None = None) -> None:
    run_info = {
        "config": config.to_dict(), "stores": data.recorded_urls, "dataset_ids": data.dataset_ids,
        "target": fingerprint(data.target), "drafter": drafter_config.to_dict(),
        "state_rms": state_rms, "noise_std_relative": config.noise_std,
        "noise_std_absolute": config.noise_std * state_rms, "precision": str(dtype).removeprefix("torch."),
        "host_allocator": loaded_allocator(),  # the malloc the run's host memory figures were measured on
        **({} if val is None else {"validation": val.record()}),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_CONFIG).write_text(json.dumps(run_info, indent=2) + "\n", encoding="utf-8")


def _stage_loss(config: TrainConfig, stage: int) -> Callable[..., LossSums]:
    """The form's loss for this stage (EAGLE-2: one teacher-forced loss for every epoch, docs/method.md §7)."""
    return form_for(config.drafter, config.residual).stage_loss(stage)


def _train_epochs(run: _Run, on_step: Callable[[dict[str, Any], int], None] | None) -> tuple[int, int]:
    """Run the epochs from `run.start` until the plan or `max_steps` ends; returns the (epoch, batch)
    position a checkpoint resumes from."""
    phases = _phases(run.config)
    run_loss = distributed.loss_runner(run.model, run.ctx)
    position, start_batch = run.start, run.start[1]
    run.model.train()
    metrics_cm = (run.run_dir / METRICS).open("a", encoding="utf-8") if run.ctx.is_main else contextlib.nullcontext()
    with metrics_cm as metrics_file:
        while position[0] < len(phases) and run.step < run.total_steps:
            epoch = position[0]
            loss_fn = _stage_loss(run.config, phases[epoch])
            position = (epoch + 1, 0)  # where to go if this epoch has no batch left
            for batch_index, batch, wait in _step_batches(run, epoch, start_batch):
                if run.step >= run.total_steps:
                    position = (epoch, batch_index)
                    break
                done = batch_index + 1 == len(run.plans[epoch])
                position = (epoch + 1, 0) if done else (epoch, batch_index + 1)
                metrics = _optimizer_step(run, run_loss, loss_fn, batch, wait, stage=phases[epoch], epoch=epoch)
                _refuse_non_finite_loss(run, metrics, run.plans[epoch][batch_index])
                _log_step(run, metrics, metrics_file, on_step, position)
            start_batch = 0
    return position


def _refuse_non_finite_loss(run: _Run, metrics: dict[str, Any], samples: list[int]) -> None:
    """Stop at the first step whose loss is nan or inf, before it is logged or saved: one NaN state in a store
    (or a diverging rate) otherwise trains every weight to NaN and still ends with rc 0. The loss is already
    on the host (the step's one sync), so the check costs nothing."""
    loss = metrics["loss"]
    if math.isfinite(loss):
        return
    named = ", ".join(map(str, samples[:8])) + (" ..." if len(samples) > 8 else "")
    kept = f"the last checkpoint (step {run.last_saved}) is intact" if run.last_saved > 0 else "nothing was saved"
    raise RunStateError(f"step {metrics['step']} (epoch {metrics['epoch']}): the loss is {loss} on samples [{named}] "
                        f"of {run.data.urls}; run `beagle-pipeline verify` on the store (non-finite states) or "
                        f"lower --lr; {kept}")


def _step_batches(run: _Run, epoch: int, start: int) -> Iterator[tuple[int, list[Batch], float]]:
    """(batch index, this rank's micro-batches of it, seconds waited for them) from batch `start` on.

    The global batch's rows are cut into world_size x grad_accum contiguous slices, padded to its longest
    sample (beagle.distributed's rank slicing, once more per micro-batch): micro-batch m of rank r is
    slice r·G + m. One loader per micro-batch, each reading its slice of the next batch ahead."""
    parts, rank, world = run.config.grad_accum, run.ctx.rank, run.ctx.world_size
    loaders = [Loader(run.data, run.plans[epoch], limit=run.config.sequence_limit, start=start,
                      shard=(rank * parts + m, world * parts), device=run.device) for m in range(parts)]
    for items in zip(*loaders):
        yield items[0][0], [batch for _, batch, _ in items], sum(wait for _, _, wait in items)


def build_optimizer(model: torch.nn.Module, device: torch.device, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the drafter's (fp32) parameters with the config's lr, betas and weight decay (said once, in
    TrainConfig), in torch's fused kernel on CPUs and GPUs (one pass over each parameter instead of several).
    One builder for the trainer and bench/train.py, so the bench steps as the trainer does; on 2 CPU cores the
    fused kernel measured within noise of the default (docs/benchmarks.md)."""
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
                             fused=fused or None)


def _optimizer_step(run: _Run, run_loss: Callable[..., LossSums], loss_fn: Callable[..., LossSums],
                    batch: Batch | list[Batch], wait: float, *, stage: int, epoch: int) -> dict[str, Any]:
    """One optimizer step on one (global) batch, given as this rank's micro-batches of it (or its one
    slice); returns its metrics line."""
    config, ctx = run.config, run.ctx
    t0 = time.perf_counter()
    batches = [b.to(run.device) for b in (batch if isinstance(batch, list) else [batch])]
    offset = window_offset(config.seed, run.step, config.window_size)
    lr = _learning_rate(config, run.step, run.total_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    if len(batches) == 1:
        with autocast(run.device, run.dtype):
            sums = run_loss(loss_fn, batches[0], offset, run.settings, run.generator)
        result = sums.finish(distributed.global_sum)  # normalised by the global batch's row weights
        (result.loss * ctx.world_size).backward()  # DDP averages gradients over ranks
    else:
        result = _accumulate(run, run_loss, loss_fn, batches, offset, stage)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    run.optimizer.step()
    run.step += 1
    tokens = sum(b.tokens for b in batches)
    stats = distributed.step_stats(result, tokens, ctx, grad_norm)  # the global batch's; the one sync
    busy = time.perf_counter() - t0 + wait
    return {
        "step": run.step, "stage": stage, "epoch": epoch, "loss": stats.loss,
        "token_loss": stats.token_loss, "regression_loss": stats.regression_loss,
        "accuracy": [c / n if n else None for c, n in zip(stats.correct, stats.count)],
        "rows": stats.count, "tokens": stats.tokens, "lr": lr,
        "grad_norm": stats.grad_norm, "tokens_per_s": stats.tokens / max(busy, 1e-9),
        "data_wait_fraction": wait / max(busy, 1e-9),
    }


def _accumulate(run: _Run, run_loss: Callable[..., LossSums], loss_fn: Callable[..., LossSums],
                batches: list[Batch], offset: int, stage: int) -> LossResult:
    """Forward and backward each micro-batch, gradients summing to the whole batch's; returns the batch's
    loss terms (sums of the micro-batches', each normalised by the whole batch's row weights).

    Why it equals one pass over the batch: the loss is a weighted mean whose denominators (row weights per
    depth) depend on the loss mask alone, so they are summed over the micro-batches (and ranks) before any
    forward; the generator is rewound for each micro-batch, which draws the key noise of the whole batch and
    keeps its own rows (Batch.noise), so each row gets the noise it gets without accumulation. Under DDP the
    gradient all-reduce runs once, in the last micro-batch's backward."""
    weights_of = form_for(run.config.drafter, run.config.residual).stage_weights(stage)
    total = distributed.global_sum(sum(weights_of(b, offset, run.settings) for b in batches))  # [k]
    start = run.generator.get_state()
    parts: list[LossResult] = []
    for index, micro in enumerate(batches):
        run.generator.set_state(start)
        with distributed.no_sync(run_loss, last=index == len(batches) - 1):
            with autocast(run.device, run.dtype):
                sums = run_loss(loss_fn, micro, offset, run.settings, run.generator)
            result = sums.finish(lambda _: total)
            (result.loss * run.ctx.world_size).backward()
        parts.append(result)
    return LossResult(*(torch.stack([getattr(p, name).detach() for p in parts]).sum(0)
                        for name in ("loss", "token_loss", "regression_loss", "correct", "count")))


def window_offset(seed: int, step: int, window_size: int) -> int:
    """The step's window offset (docs/method.md §2), drawn on the host from (seed, step): no device
    generator to wait for, and a resumed run draws the same offsets."""
    return random.Random(seed * 1_000_003 + step).randrange(window_size)


def _learning_rate(config: TrainConfig, step: int, total_steps: int) -> float:
    """Linear warm-up to `config.lr`, then constant, or decayed (cosine or linear) to 0 at `total_steps`: a run
    whose length is known ends on small steps instead of the peak rate (docs/training.md, the levers)."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    progress = min(1.0, (step - config.warmup_steps + 1) / max(1, total_steps - config.warmup_steps))
    if config.lr_schedule == "linear":
        return config.lr * (1.0 - progress)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def _log_step(run: _Run, metrics: dict[str, Any], metrics_file: Any,
              on_step: Callable[[dict[str, Any], int], None] | None, position: tuple[int, int]) -> None:
    """Append the metrics line, report progress, validate when due (every rank), and checkpoint when due
    (rank 0 only). The validation line is written before the checkpoint of its step, so a resume from that
    checkpoint keeps it."""
    run.last_metrics = metrics
    if metrics_file is not None:
        metrics_file.write(json.dumps(metrics) + "\n")
        metrics_file.flush()
    if on_step is not None:
        on_step(metrics, run.total_steps)
    if run.val is not None and (run.step % run.config.eval_every == 0 or run.step == run.total_steps):
        _validate(run, metrics_file, stage=metrics["stage"], epoch=metrics["epoch"])
    if run.ctx.is_main and (run.step % run.config.checkpoint_every == 0 or run.step == run.total_steps):
        _save(run, position)


def _validate(run: _Run, metrics_file: Any, *, stage: int, epoch: int) -> None:
    """Score the held-out samples with this stage's loss and the offline chain of window_size drafts."""
    t0 = time.perf_counter()
    result = evaluate(run.model, run.val, loss_fn=_stage_loss(run.config, stage), settings=run.settings,
                      depth=run.config.window_size, lm_head=run.model.lm_head,
                      vocab=None if run.draft_tokens is None else run.draft_tokens.to(run.device),
                      device=run.device, dtype=run.dtype, limit=run.config.sequence_limit, ctx=run.ctx)
    record = metrics_record(result, step=run.step, stage=stage, epoch=epoch, seconds=time.perf_counter() - t0)
    run.last_validation = record
    log.info("step %d validation: loss %.4f, tau %.3f over %d samples", run.step, record["loss"], record["tau"],
             record["samples"])
    if metrics_file is not None:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()


def _save(run: _Run, position: tuple[int, int]) -> None:
    save_checkpoint(run.run_dir, step=run.step, model=run.model, optimizer=run.optimizer, generator=run.generator,
                    position={"epoch": position[0], "batch": position[1]})
    run.last_saved = run.step


def _finish_run(run: _Run, position: tuple[int, int]) -> None:
    """Rank 0: a final checkpoint if the last step has none, and the drafter export."""
    if run.last_saved != run.step:
        _save(run, position)
    save_drafter(run.run_dir / "drafter", run.model, metadata={
        "dataset_ids": run.data.dataset_ids, "stores": run.data.recorded_urls, "target": fingerprint(run.data.target),
        "train_steps": run.step, "window_size": run.config.window_size,
        "simulation_steps": run.config.simulation_steps, "precision": str(run.dtype).removeprefix("torch."),
        **({} if run.draft_tokens is None else {"draft_vocab": run.draft_tokens.tolist()}),
    })
