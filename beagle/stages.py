"""The two training stages as forward passes that return a loss (spec §2, §3, §8).

Both take a padded batch of true target states T [B, L, d]. Row i (query token t_i at position i)
predicts h_i and, through the LM head, t_{i+1}; its loss weight is loss_mask[i+1], and rows without a
visible true key (the first window) are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from beagle.data import Batch
from beagle.losses import LossResult, beta_weights, drafter_loss
from beagle.masks import depth, depth_positions, stage1_mask, stage2_mask, window_index
from beagle.model import BeagleDrafter


@dataclass(frozen=True)
class StageSettings:
    window_size: int
    simulation_steps: int
    noise_std: float            # absolute std (already multiplied by the states' RMS)
    regression_weight: float
    vocab_chunk: int
    detach_feedback: bool = False


def _row_weights(batch: Batch, offset: int, window_size: int) -> Tensor:
    """[B, L] loss weight per query row: next token is an assistant token and a true key is visible."""
    B, L = batch.input_ids.shape
    weight = torch.zeros(B, L, device=batch.input_ids.device)
    weight[:, :-1] = batch.loss_mask[:, 1:].float()
    pos = torch.arange(L, device=weight.device)
    w = window_index(pos, window_size, offset)
    weight[:, w == w[0]] = 0.0                       # first window: nothing true to attend to
    return weight


def noisy_keys(model: BeagleDrafter, batch: Batch, noise_std: float,
               generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Project the (noised) true states once: k, v [B, H_kv, L, hd] and positions [B, L]."""
    B, L, d = batch.hidden.shape
    states = batch.hidden
    if noise_std > 0:
        noise = torch.randn(states.shape, generator=generator, device=states.device, dtype=states.dtype)
        states = states + noise_std * noise                                      # [B, L, d]
    positions = torch.arange(L, device=states.device).expand(B, L)
    k, v = model.project_keys(states, positions)
    return k, v, positions


def stage1_loss(model: BeagleDrafter, batch: Batch, offset: int, settings: StageSettings,
                generator: torch.Generator | None = None) -> LossResult:
    """Block attention: every position is a query once, seeing only true keys of earlier windows."""
    B, L, d = batch.hidden.shape
    dev = batch.hidden.device
    k_true, v_true, positions = noisy_keys(model, batch, settings.noise_std, generator)
    key_valid = torch.arange(L, device=dev)[None, :] < batch.lengths[:, None]   # [B, L]
    mask = stage1_mask(L, settings.window_size, offset, dev)[None, None] & key_valid[:, None, None, :]
    hidden = model.forward_hidden(batch.input_ids, positions, k_true, v_true, mask)  # [B, L, d]
    weight = _row_weights(batch, offset, settings.window_size)
    depths = depth(torch.arange(L, device=dev), settings.window_size, offset).expand(B, L)
    return drafter_loss(hidden.reshape(B * L, d), batch.hidden.reshape(B * L, d), weight.reshape(-1),
                        depths.reshape(-1), model.lm_head, num_depths=settings.window_size,
                        depth_weights=None, regression_weight=settings.regression_weight,
                        chunk_size=settings.vocab_chunk)


def stage2_loss(model: BeagleDrafter, batch: Batch, offset: int, settings: StageSettings,
                generator: torch.Generator | None = None) -> LossResult:
    """Training-time simulation: step j computes only the queries at depth j. They see true keys of
    earlier windows plus the drafter's own predictions for depths 1..j-1 of their window."""
    B, L, d = batch.hidden.shape
    dev = batch.hidden.device
    k_size = settings.window_size
    k_true, v_true, _ = noisy_keys(model, batch, settings.noise_std, generator)
    key_valid = torch.arange(L, device=dev)[None, :] < batch.lengths[:, None]   # [B, L]
    weight_all = _row_weights(batch, offset, k_size)                           # [B, L]
    pred_k: list[Tensor] = []
    pred_v: list[Tensor] = []
    pred_pos: list[Tensor] = []
    rows_hidden, rows_target, rows_weight, rows_depth = [], [], [], []
    for step in range(1, settings.simulation_steps + 1):
        q_pos = depth_positions(L, k_size, offset, step, dev)                  # [Lq]
        if q_pos.numel() == 0:
            continue
        Lq = q_pos.numel()
        predicted = torch.cat(pred_pos) if pred_pos else q_pos[:0]             # [Lp]
        mask = stage2_mask(q_pos, L, predicted, k_size, offset)[None, None]    # [1, 1, Lq, L + Lp]
        valid = torch.cat([key_valid, key_valid[:, predicted]], dim=1)         # [B, L + Lp]
        mask = mask & valid[:, None, None, :]
        k = torch.cat([k_true, *pred_k], dim=2)                                # [B, H_kv, L + Lp, hd]
        v = torch.cat([v_true, *pred_v], dim=2)
        q_positions = q_pos.expand(B, Lq)
        hidden = model.forward_hidden(batch.input_ids[:, q_pos], q_positions, k, v, mask)  # [B, Lq, d]
        if step < settings.simulation_steps:
            fed_back = hidden.detach() if settings.detach_feedback else hidden
            kp, vp = model.project_keys(fed_back, q_positions)                 # [B, H_kv, Lq, hd]
            pred_k.append(kp)
            pred_v.append(vp)
            pred_pos.append(q_pos)
        rows_hidden.append(hidden.reshape(B * Lq, d))
        rows_target.append(batch.hidden[:, q_pos].reshape(B * Lq, d))
        rows_weight.append(weight_all[:, q_pos].reshape(-1))
        rows_depth.append(torch.full((B * Lq,), step, device=dev, dtype=torch.long))
    return drafter_loss(torch.cat(rows_hidden), torch.cat(rows_target), torch.cat(rows_weight),
                        torch.cat(rows_depth), model.lm_head, num_depths=k_size,
                        depth_weights=beta_weights(settings.simulation_steps),
                        regression_weight=settings.regression_weight, chunk_size=settings.vocab_chunk)
