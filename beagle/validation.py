"""Held-out validation during training (`train --val-samples N`, `--val-store URL`, `--eval-every S`).

What every trainer's users expect (nanoGPT's `estimate_loss`): a loss on samples the drafter never trained
on, so over-fitting a small store shows as a gap between the two curves, and, for a drafter, the number that
matters, the offline acceptance per depth and τ (`beagle.offline_acceptance`, the estimator bench reports).

The split is a pure function of (seed, number of samples, N), so a resumed run holds out the same samples;
the run config records the indices and the trainer checks them on resume. Evaluation reads no random state
the training reads (no key noise, a fixed window offset per sample), so a run with validation trains exactly
as the same run without it would on the same training samples.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from beagle import distributed
from beagle.data import StoreSet, collate, fingerprint
from beagle.errors import SettingsError
from beagle.losses import DepthSums, LossSums
from beagle.offline_acceptance import Acceptance, batch_acceptance
from beagle.precision import autocast
from beagle.stages import StageSettings
from beagle.train_config import TrainConfig

log = logging.getLogger(__name__)

# The split's own random stream: the batch plans draw from default_rng([seed, epoch]) with small epochs.
_SPLIT_STREAM = 7_166_572


@dataclass(frozen=True)
class ValidationSet:
    """Held-out samples and how they are evaluated. `batches` are lists of indices into `data`; every
    batch holds samples of one window offset (`offsets`), so a sample's loss does not depend on how the
    samples were batched or over how many ranks."""

    data: StoreSet
    indices: list[int]          # the held-out samples of `data`, ascending
    batches: list[list[int]]
    offsets: list[int]          # window offset of each batch
    held_out: bool              # True: held out of the training stores; False: a store of its own (--val-store)

    def record(self) -> dict[str, Any]:
        """What run_config.json keeps, so a resume can check it validates on the same samples."""
        return {"held_out": self.held_out, "stores": self.data.urls, "dataset_ids": self.data.dataset_ids,
                "samples": len(self.indices), "indices": self.indices}


def holdout_indices(num_samples: int, count: int, seed: int) -> list[int]:
    """`count` of `num_samples` sample indices, ascending, drawn by `seed` alone."""
    rng = np.random.default_rng([seed, _SPLIT_STREAM])
    return sorted(int(i) for i in rng.permutation(num_samples)[:count])


def _pack(indices: list[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Longest first, as many samples per batch as keep B x longest <= budget (at least one)."""
    order = sorted(indices, key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def plan_validation(data: StoreSet, indices: list[int], *, window_size: int, budget: int, limit: int,
                    min_batches: int, held_out: bool) -> ValidationSet:
    """Batches of the held-out samples: sample j (in ascending order) gets window offset j mod k, and the
    samples of one offset are packed by `budget` tokens; batches are split until there are `min_batches`
    (one per rank, so every rank takes part in the reduction with the loss's own shapes)."""
    if len(indices) < min_batches:
        raise SettingsError(f"--val-samples {len(indices)} is fewer than the {min_batches} data-parallel ranks; "
                         f"hold out at least {min_batches} samples (each rank evaluates a share)")
    lengths = np.minimum(data.lengths, limit)
    batches, offsets = [], []
    for offset in range(window_size):
        for batch in _pack(indices[offset::window_size], lengths, budget):
            batches.append(batch)
            offsets.append(offset)
    while len(batches) < min_batches:  # split the batch of most rows; each half keeps its offset
        at = max(range(len(batches)), key=lambda b: len(batches[b]))
        rows = batches[at]
        batches[at:at + 1] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
        offsets[at:at + 1] = [offsets[at]] * 2
    return ValidationSet(data, list(indices), batches, offsets, held_out)


def open_validation(data: StoreSet, config: TrainConfig, *, world_size: int, rank: int = 0,
                    cache_dir: str | None = None, verify: bool = True
                    ) -> tuple[np.ndarray | None, ValidationSet | None]:
    """(training sample indices or None for all of them, the validation set or None) for a run.

    In-store hold-out: `config.val_samples` of the training stores' samples, drawn by seed, leave training.
    `config.val_store`: that store (of the same target, not one of the training stores) is evaluated, all of
    it or `val_samples` of it, and training keeps every sample of its stores."""
    if not config.validates:
        return None, None
    budget = max(1, config.batch_tokens // (world_size * config.grad_accum))  # one micro-batch's tokens
    plan = dict(window_size=config.window_size, budget=budget, limit=config.sequence_limit, min_batches=world_size)
    if config.val_store is None:
        n = len(data)
        if config.val_samples >= n:
            raise SettingsError(f"--val-samples {config.val_samples} leaves no training sample: the stores hold {n} "
                             f"samples; hold out fewer (at most {n - 1}) or pass a separate --val-store")
        held = holdout_indices(n, config.val_samples, config.seed)
        train = np.setdiff1d(np.arange(n), held)
        log.info("validation: %d of %d samples held out (seed %d)", len(held), n, config.seed)
        return train, plan_validation(data, held, held_out=True, **plan)
    val = StoreSet([config.val_store], cache_dir=cache_dir, verify=verify, key_layers=data.key_layers,
                   verify_share=(rank, world_size))
    if fingerprint(val.target) != fingerprint(data.target):
        raise SettingsError(f"--val-store {config.val_store} comes from target {fingerprint(val.target)}, the training "
                         f"stores from {fingerprint(data.target)}; validate on a store of the same target")
    if val.dataset_ids[0] in data.dataset_ids:
        raise SettingsError(f"--val-store {config.val_store} is one of the training stores (dataset_id "
                         f"{val.dataset_ids[0][:12]}); pass a store of other samples, or --val-samples N alone "
                         "to hold N training samples out")
    if config.val_samples > len(val):
        raise SettingsError(f"--val-samples {config.val_samples} exceeds the {len(val)} samples of --val-store "
                         f"{config.val_store}; pass at most {len(val)} (or 0 for all of them)")
    count = config.val_samples or len(val)
    held = holdout_indices(len(val), count, config.seed) if count < len(val) else list(range(len(val)))
    log.info("validation: %d of the %d samples of %s", len(held), len(val), config.val_store)
    return None, plan_validation(val, held, held_out=False, **plan)


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    token_loss: float
    regression_loss: float
    correct: list[int]          # per loss depth: draft top-1 == target top-1
    count: list[int]            # loss rows per depth
    acceptance: Acceptance
    samples: int
    tokens: int


def evaluate(model: nn.Module, val: ValidationSet, *, loss_fn: Callable[..., LossSums], settings: StageSettings,
             depth: int, lm_head: Tensor, vocab: Tensor | None, device: torch.device, dtype: torch.dtype,
             limit: int, ctx: distributed.DistContext = distributed.SINGLE) -> ValidationResult:
    """The stage loss (without key noise) and the offline chain acceptance of `model` on `val`.

    Each rank evaluates every world_size-th batch; the sums are all-reduced once (every rank calls this
    together). Eval mode and no gradients; the model's mode is restored. lm_head [V, d]: the target's head
    the greedy tokens come from (the run's frozen one); vocab: the draft vocabulary, drafted over as `eval`
    does."""
    was_training = model.training
    model.eval()
    quiet = replace(settings, noise_std=0.0)    # no draw from the training generator
    parts: list[DepthSums] = []
    counts = torch.zeros(depth + 1, dtype=torch.long, device=device)
    tokens = samples = 0
    template: LossSums | None = None  # a batch's sums: the loss's depth weights and scale
    try:
        with torch.no_grad(), autocast(device, dtype):
            for b in range(ctx.rank, len(val.batches), ctx.world_size):
                rows = val.batches[b]
                batch = collate([val.data.sample(i, limit) for i in rows]).to(device)
                template = loss_fn(model, batch, val.offsets[b], quiet, None)
                parts.append(template.sums)
                counts += batch_acceptance(model, batch, lm_head, depth=depth, vocab=vocab)
                tokens += batch.tokens
                samples += len(rows)
    finally:
        model.train(was_training)
    assert template is not None, "plan_validation gives every rank a batch"
    sums = DepthSums(*(torch.stack([getattr(p, f) for p in parts]).sum(0)
                       for f in ("token", "regression", "weight", "correct", "count")))
    k = sums.token.numel()
    flat = torch.cat([sums.token.double(), sums.regression.double(), sums.weight.double(), sums.correct.double(),
                      sums.count.double(), counts.double(),
                      torch.tensor([tokens, samples], dtype=torch.float64, device=device)])  # [5k + depth + 3]
    flat = distributed.global_sum(flat).cpu()
    total = DepthSums(*(flat[i * k:(i + 1) * k] for i in range(5)))
    result = LossSums(total, template.depth_weights, template.regression_weight, template.scale).finish()
    ints = [int(round(x)) for x in flat[5 * k:].tolist()]
    return ValidationResult(float(result.loss), float(result.token_loss), float(result.regression_loss),
                            _ints(total.correct), _ints(total.count), Acceptance(tuple(ints[:depth + 1])),
                            ints[-1], ints[-2])


def _ints(t: Tensor) -> list[int]:
    """A float tensor of counts as ints (they crossed the all-reduce as float64)."""
    return [int(round(x)) for x in t.tolist()]


def metrics_record(result: ValidationResult, *, step: int, stage: int, epoch: int, seconds: float) -> dict[str, Any]:
    """The metrics.jsonl line of one validation: `split` "val" tells it from the training steps' lines."""
    return {
        "step": step, "split": "val", "stage": stage, "epoch": epoch, "loss": result.loss,
        "token_loss": result.token_loss, "regression_loss": result.regression_loss,
        "accuracy": [c / n if n else None for c, n in zip(result.correct, result.count)], "rows": result.count,
        "acceptance": result.acceptance.alphas, "tau": result.acceptance.tau, "roots": result.acceptance.roots,
        "samples": result.samples, "tokens": result.tokens, "seconds": seconds,
    }
