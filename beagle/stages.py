"""The two training stages as forward passes that return a loss (docs/method.md §2-§4), for both Beagle
forms: the embedding residual (§1) and the state residual, the engine form (§9).

Both take a padded batch of true target states T [B, L, d]. Row i (query token t_i at position i)
predicts h_i and, through the LM head, t_{i+1}; its loss weight is loss_mask[i+1], and rows without a
visible true key (the first window) are dropped. A state-residual drafter (`carries_state`) also starts
each row's residual stream from a state: in stage 1 the last true state before the row's window, in stage
2 its own output at the previous depth, as in drafting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from beagle.data import Batch
from beagle.losses import DepthSums, LossSums, beta_weights, default_vocab_chunk, depth_sums, drafter_loss_sums
from beagle.masks import depth, depth_positions, stage1_mask, stage2_mask, window_index
from beagle.model import fuse_key_states, loss_head
from beagle.train_config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class StageSettings:
    """What the stage losses need of a run's configuration. Keyword-only: several fields are floats or
    ints that would swap silently if filled by position. The trainer builds it in `from_config`."""

    window_size: int
    simulation_steps: int
    noise_std: float            # absolute std (already multiplied by the states' RMS)
    regression_weight: float
    vocab_chunk: int
    detach_feedback: bool = False
    recompute: bool = True      # activation checkpointing per stage-2 step (flat memory)
    # Drop loss-less rows before the LM head (a host sync: free on a CPU); off on accelerators, whose
    # training step then never waits for the host (losses.depth_sums).
    compact_rows: bool = True

    @classmethod
    def from_config(cls, config: TrainConfig, state_rms: float,
                    device: torch.device | None = None) -> "StageSettings":
        """The settings of a training run; `state_rms` turns the relative noise into an absolute std."""
        return cls(window_size=config.window_size, simulation_steps=config.simulation_steps,
                   noise_std=config.noise_std * state_rms, regression_weight=config.regression_weight,
                   vocab_chunk=config.vocab_chunk or default_vocab_chunk(device),
                   detach_feedback=config.detach_feedback,
                   recompute=config.stage2_recompute, compact_rows=device is None or device.type == "cpu")


def _row_weights(batch: Batch, offset: int, window_size: int) -> Tensor:
    """[B, L] loss weight per query row: next token is an assistant token and a true key is visible."""
    B, L = batch.input_ids.shape
    weight = torch.zeros(B, L, device=batch.input_ids.device)
    weight[:, :-1] = batch.loss_mask[:, 1:].float()
    pos = torch.arange(L, device=weight.device)
    w = window_index(pos, window_size, offset)
    return weight * (w != w[0])                      # first window: nothing true to attend to (no sync)


def noisy_states(model: torch.nn.Module, batch: Batch, noise_std: float,
                 generator: torch.Generator | None) -> Tensor:
    """The (noised) true key states [B, L, d]: a drafter with fused keys fuses the key layers first; the
    noise is added in the fused space, the one its own predicted states are fed back into in stage 2."""
    states = fuse_key_states(model, batch.key_input(model.config.reads_key_states))          # [B, L, d]
    if noise_std > 0:
        states = states + noise_std * batch.noise(generator)                                      # [B, L, d]
    return states


def noisy_keys(model: torch.nn.Module, batch: Batch, noise_std: float,
               generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Project the (noised) true states once: k, v [B, H_kv, L, hd] and positions [B, L]."""
    states = noisy_states(model, batch, noise_std, generator)
    B, L, _ = states.shape
    positions = torch.arange(L, device=states.device).expand(B, L)
    k, v = model.project_keys(states, positions)
    return k, v, positions


def window_anchor_states(states: Tensor, window_size: int, offset: int) -> Tensor:
    """[B, L, d]: for every position p the last true state before its window (position p - d(p), clamped
    at 0), the residual a state-carrying query starts from in stage 1 (docs/method.md §9.2). Depth-1 rows get
    the previous position's state, exactly what drafting gives them; deeper rows may not carry a state of
    their own window, which drafting would not have."""
    L = states.shape[1]
    pos = torch.arange(L, device=states.device)
    anchor = (pos - depth(pos, window_size, offset)).clamp(min=0)                        # [L]
    return states[:, anchor]


def stage1_loss(model: torch.nn.Module, batch: Batch, offset: int, settings: StageSettings,
                generator: torch.Generator | None = None) -> LossSums:
    """Block attention: every position is a query once, seeing only true keys of earlier windows."""
    B, L, d = batch.hidden.shape
    dev = batch.hidden.device
    states = noisy_states(model, batch, settings.noise_std, generator)                   # [B, L, d]
    positions = torch.arange(L, device=dev).expand(B, L)
    k_true, v_true = model.project_keys(states, positions)
    key_valid = torch.arange(L, device=dev)[None, :] < batch.lengths[:, None]   # [B, L]
    mask = stage1_mask(L, settings.window_size, offset, dev)[None, None] & key_valid[:, None, None, :]
    residual = window_anchor_states(states, settings.window_size, offset) if model.carries_state else None
    hidden = model.forward_hidden(batch.input_ids, positions, k_true, v_true, mask, residual)  # [B, L, d]
    weight = _row_weights(batch, offset, settings.window_size)
    depths = depth(torch.arange(L, device=dev), settings.window_size, offset).expand(B, L)
    return drafter_loss_sums(model.head_input(hidden).reshape(B * L, d), batch.hidden.reshape(B * L, d),
                             weight.reshape(-1), depths.reshape(-1), loss_head(model), num_depths=settings.window_size,
                             depth_weights=None, regression_weight=settings.regression_weight,
                             chunk_size=settings.vocab_chunk, compact=settings.compact_rows)


def stage1_weights(batch: Batch, offset: int, settings: StageSettings) -> Tensor:
    """[k] summed row weights per depth of `batch`: the denominators `stage1_loss` normalises by.

    Why apart from the loss: gradient accumulation (`train --grad-accum`) must know the whole step's
    denominators before the first micro-batch's backward; they depend on the loss mask alone."""
    B, L = batch.input_ids.shape
    weight = _row_weights(batch, offset, settings.window_size)                          # [B, L]
    depths = depth(torch.arange(L, device=weight.device), settings.window_size, offset).expand(B, L)
    return torch.zeros(settings.window_size, device=weight.device).index_add(0, depths.reshape(-1) - 1,
                                                                             weight.reshape(-1))


def _stage2_depth_weights(weight_all: Tensor, offset: int, settings: StageSettings) -> Tensor:
    """[k] summed row weights of the simulated depths 1..s from the rows' weights [B, L] (0 beyond s)."""
    L, k = weight_all.shape[1], settings.window_size
    weight_sum = torch.zeros(k, device=weight_all.device)
    for step in range(1, min(settings.simulation_steps, k) + 1):
        weight_sum[step - 1] = weight_all[:, depth_positions(L, k, offset, step, weight_all.device)].sum()
    return weight_sum


def stage2_weights(batch: Batch, offset: int, settings: StageSettings) -> Tensor:
    """[k] the denominators `stage2_loss` normalises by (see `stage1_weights`)."""
    return _stage2_depth_weights(_row_weights(batch, offset, settings.window_size), offset, settings)


StepReduce = Callable[[int, Tensor, Tensor], tuple[Tensor, ...]]


def _keep_states(step: int, q_pos: Tensor, hidden: Tensor) -> tuple[Tensor, ...]:
    return (hidden,)


def simulate(model: torch.nn.Module, batch: Batch, offset: int, settings: StageSettings,
             generator: torch.Generator | None = None,
             reduce: StepReduce = _keep_states) -> list[tuple[int, Tensor, tuple[Tensor, ...]]]:
    """Training-time simulation: step j computes only the queries at depth j. They see true keys of
    earlier windows plus the drafter's own predictions for depths 1..j-1 of their window. A state-carrying
    drafter's depth-j query also starts its residual from its own depth j-1 output at the previous position
    (the true previous state at depth 1), as in drafting.

    `reduce(step, query positions [Lq], draft states [B, Lq, d])` runs inside each step's block and
    returns what the step hands out (by default the draft states themselves; the LM head reads
    `model.head_input` of them). With `settings.recompute` the block runs under activation checkpointing:
    autograd then keeps only its inputs (the shared true key bank, the predicted keys of earlier steps and
    the previous step's states) and its outputs. When `reduce` returns loss sums rather than states,
    nothing per trained row survives a step, and peak memory stays flat in the number of steps.
    Returns [(step, query positions [Lq], reduce's outputs)] for steps 1..s."""
    B, L, d = batch.hidden.shape
    dev = batch.hidden.device
    k_size = settings.window_size
    states = noisy_states(model, batch, settings.noise_std, generator)                   # [B, L, d]
    k_true, v_true = model.project_keys(states, torch.arange(L, device=dev).expand(B, L))
    key_valid = torch.arange(L, device=dev)[None, :] < batch.lengths[:, None]   # [B, L]
    pred_keys: list[Tensor] = []       # predicted keys [B, H_kv, Lq, hd], one per earlier step
    pred_values: list[Tensor] = []
    pred_pos: list[Tensor] = []        # their positions; at most L slots over all steps (docs/method.md §3)
    carried = states if model.carries_state else None   # [B, Lp, d]: what the next step's residuals come from
    carried_pos = None                 # positions of `carried` (None: every position, the true states)
    out = []
    for step in range(1, settings.simulation_steps + 1):
        q_pos = depth_positions(L, k_size, offset, step, dev)                  # [Lq]
        if q_pos.numel() == 0:
            continue
        feed_back = step < settings.simulation_steps
        residual_index = None if carried is None else _previous_rows(q_pos, carried_pos)
        run = _SimulationStep(model, settings, offset, step, q_pos, pred_pos, key_valid, L, feed_back, reduce,
                              residual_index)
        inputs = (batch.input_ids, k_true, v_true, *pred_keys, *pred_values,
                  *(() if carried is None else (carried, states)))
        if settings.recompute and torch.is_grad_enabled():
            results = checkpoint(run, *inputs, use_reentrant=False)
        else:
            results = run(*inputs)
        if feed_back and carried is not None:
            *results, kp, vp, carried = results
            carried_pos = q_pos
        elif feed_back:
            *results, kp, vp = results
        if feed_back:
            pred_keys.append(kp)
            pred_values.append(vp)
            pred_pos.append(q_pos)
        out.append((step, q_pos, tuple(results)))
    return out


def _previous_rows(q_pos: Tensor, carried_pos: Tensor | None) -> tuple[Tensor, Tensor]:
    """For queries at q_pos [Lq]: the row of `carried` holding position p - 1 ([Lq], clamped), and whether
    it is there ([Lq] bool). `carried_pos` None: `carried` holds every position (the true states)."""
    previous = (q_pos - 1).clamp(min=0)
    if carried_pos is None:
        return previous, q_pos >= 1
    rows = torch.searchsorted(carried_pos, previous).clamp(max=carried_pos.numel() - 1)
    return rows, (carried_pos[rows] == q_pos - 1)


class _SimulationStep:
    """One stage-2 step as a pure function of tensors, so it can be recomputed in backward."""

    def __init__(self, model: torch.nn.Module, settings: StageSettings, offset: int, step: int, q_pos: Tensor,
                 pred_pos: list[Tensor], key_valid: Tensor, length: int, feed_back: bool,
                 reduce: StepReduce, residual_index: tuple[Tensor, Tensor] | None) -> None:
        self.model, self.settings, self.offset, self.step, self.q_pos = model, settings, offset, step, q_pos
        self.pred_pos, self.key_valid, self.length, self.feed_back = list(pred_pos), key_valid, length, feed_back
        self.reduce, self.residual_index = reduce, residual_index

    def __call__(self, input_ids: Tensor, k_true: Tensor, v_true: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        n = len(self.pred_pos)
        bank, carried = rest[:2 * n], rest[2 * n:]
        B, Lq = input_ids.shape[0], self.q_pos.numel()
        predicted = torch.cat(self.pred_pos) if n else self.q_pos[:0]                      # [Lp]
        mask = stage2_mask(self.q_pos, self.length, predicted, self.settings.window_size,
                           self.offset)[None, None]                                         # [1, 1, Lq, L + Lp]
        valid = torch.cat([self.key_valid, self.key_valid[:, predicted]], dim=1)           # [B, L + Lp]
        mask = mask & valid[:, None, None, :]
        k = torch.cat([k_true, *bank[:n]], dim=2)                                          # [B, H_kv, L + Lp, hd]
        v = torch.cat([v_true, *bank[n:]], dim=2)
        q_positions = self.q_pos.expand(B, Lq)
        residual = None
        if carried:
            previous, true_states = carried                                                 # [B, Lc, d], [B, L, d]
            rows, present = self.residual_index                                             # [Lq] each
            fallback = true_states[:, (self.q_pos - 1).clamp(min=0)]                        # never trained: weight 0
            residual = torch.where(present[None, :, None], previous[:, rows], fallback)    # [B, Lq, d]
        hidden = self.model.forward_hidden(input_ids[:, self.q_pos], q_positions, k, v, mask, residual)  # [B, Lq, d]
        results = self.reduce(self.step, self.q_pos, hidden)
        if not self.feed_back:
            return results
        fed_back = hidden.detach() if self.settings.detach_feedback else hidden
        kp, vp = self.model.project_keys(fed_back, q_positions)                            # [B, H_kv, Lq, hd]
        return (*results, kp, vp, fed_back) if carried else (*results, kp, vp)


def stage2_loss(model: torch.nn.Module, batch: Batch, offset: int, settings: StageSettings,
                generator: torch.Generator | None = None) -> LossSums:
    """Stage-2 loss sums: each simulated depth's mean loss, to be weighted by its normalised β_j.

    Each step's loss sums are computed inside its (recomputed) block, against per-depth row weights
    fixed up front from the loss mask, so no step keeps its draft states for backward."""
    B, L, d = batch.hidden.shape
    k = settings.window_size
    weight_all = _row_weights(batch, offset, k)                                 # [B, L]
    weight_sum = _stage2_depth_weights(weight_all, offset, settings)           # [k]

    def step_loss(step: int, q_pos: Tensor, hidden: Tensor) -> tuple[Tensor, ...]:
        sums = depth_sums(model.head_input(hidden).reshape(-1, d), batch.hidden[:, q_pos].reshape(-1, d),
                          weight_all[:, q_pos].reshape(-1),
                          torch.full((B * q_pos.numel(),), step, device=q_pos.device, dtype=torch.long),
                          loss_head(model), num_depths=k, chunk_size=settings.vocab_chunk,
                          compact=settings.compact_rows)
        return sums.token, sums.regression, sums.correct, sums.count

    steps = simulate(model, batch, offset, settings, generator, reduce=step_loss)
    token, regression, correct, count = (sum(parts) for parts in zip(*(r for _, _, r in steps)))
    return LossSums(DepthSums(token, regression, weight_sum, correct, count), beta_weights(settings.simulation_steps),
                    settings.regression_weight)
