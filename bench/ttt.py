"""An EAGLE-3 style training-time test (TTT) loop on the Beagle block, kept only to measure memory (P4).

Contrast with our stage 2 (docs/method.md §3). In TTT every position is a draft root at every step: at step j the
query at position p drafts j steps ahead of its root's true context n = p - j, so it sees the true keys
at positions <= p - j plus, from each earlier step i < j, the one predicted key of its own root
(bank i at position p - j + i, a diagonal). Each step appends a whole new key set of L predicted states
and trains all L queries again, so what autograd keeps grows linearly with the number of steps s,
while stage 2 simulates each position once, at its own depth, and stays flat.
"""
from __future__ import annotations

import torch
from torch import Tensor

from beagle.data import Batch
from beagle.losses import LossSums, beta_weights, drafter_loss_sums
from beagle.model import BeagleDrafter, loss_head
from beagle.stages import StageSettings, noisy_keys


def ttt_mask(length: int, step: int, device: torch.device | str = "cpu") -> Tensor:
    """[L, L * step] over [true keys ; bank 1 ; ... ; bank step-1] for the queries of `step` (1-based)."""
    p = torch.arange(length, device=device)
    blocks = [p[None, :] <= (p[:, None] - step)]                         # true keys of the root's context
    for i in range(1, step):
        blocks.append(p[None, :] == (p[:, None] - step + i))             # the root's own prediction at depth i
    return torch.cat(blocks, dim=1)


def ttt_forward(model: BeagleDrafter, batch: Batch, settings: StageSettings,
                generator: torch.Generator | None = None) -> list[Tensor]:
    """Draft states [B, L, d] of every step 1..s; step j's row p is p's state drafted at depth j."""
    B, L, d = batch.hidden.shape
    dev = batch.hidden.device
    k_true, v_true, positions = noisy_keys(model, batch, settings.noise_std, generator)
    key_valid = (torch.arange(L, device=dev)[None, :] < batch.lengths[:, None])    # [B, L]
    keys, values, outputs = [k_true], [v_true], []
    for step in range(1, settings.simulation_steps + 1):
        mask = ttt_mask(L, step, dev)[None, None] & key_valid.repeat(1, step)[:, None, None, :]  # [B, 1, L, jL]
        hidden = model.forward_hidden(batch.input_ids, positions, torch.cat(keys, dim=2),
                                      torch.cat(values, dim=2), mask)              # [B, L, d]
        outputs.append(hidden)
        if step < settings.simulation_steps:
            fed_back = hidden.detach() if settings.detach_feedback else hidden
            kp, vp = model.project_keys(fed_back, positions)                       # a new key set per step
            keys.append(kp)
            values.append(vp)
    return outputs


def ttt_loss(model: BeagleDrafter, batch: Batch, offset: int, settings: StageSettings,
             generator: torch.Generator | None = None) -> LossSums:
    """β-weighted loss over every (root, depth) pair; offset unused (TTT has no windows)."""
    B, L, d = batch.hidden.shape
    dev = batch.hidden.device
    steps = ttt_forward(model, batch, settings, generator)
    next_mask = torch.zeros(B, L, device=dev)
    next_mask[:, :-1] = batch.loss_mask[:, 1:].float()
    pos = torch.arange(L, device=dev)
    weights = [next_mask * (pos >= step).float()[None] for step in range(1, len(steps) + 1)]  # a true key exists
    depths = torch.cat([torch.full((B * L,), j, device=dev, dtype=torch.long) for j in range(1, len(steps) + 1)])
    return drafter_loss_sums(torch.cat([h.reshape(-1, d) for h in steps]),
                             batch.hidden.reshape(-1, d).repeat(len(steps), 1),
                             torch.cat([w.reshape(-1) for w in weights]), depths, loss_head(model),
                             num_depths=settings.simulation_steps,
                             depth_weights=beta_weights(settings.simulation_steps),
                             regression_weight=settings.regression_weight, chunk_size=settings.vocab_chunk)
