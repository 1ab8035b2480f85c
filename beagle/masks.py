"""Attention masks for both training stages (docs/method.md §2, §3). True = the query sees the key.

Windows of size k tile the sequence from an offset ε: w(p) = floor((p - ε) / k). A position's depth
d(p) = (p - ε) mod k + 1 is how many steps ahead of its window's true context n = start - 1 it drafts.

Stage 1 (inverse block mask): query p sees true key j iff w(j) < w(p).
Stage 2, step j: the queries at depth j see true keys with w(key) < w(p) and predicted keys of their
own window at earlier depths (positions n+1 .. p-1).
"""
from __future__ import annotations

import torch
from torch import Tensor


def window_index(positions: Tensor, window_size: int, offset: int) -> Tensor:
    """w(p) = floor((p - ε) / k); positions before ε fall in window -1."""
    _check(window_size, offset)
    return torch.div(positions - offset, window_size, rounding_mode="floor")


def depth(positions: Tensor, window_size: int, offset: int) -> Tensor:
    """d(p) in 1..k: 1 = an ordinary next-state prediction, k = k steps ahead of true context."""
    _check(window_size, offset)
    return torch.remainder(positions - offset, window_size) + 1


def stage1_mask(length: int, window_size: int, offset: int, device: torch.device | str = "cpu") -> Tensor:
    """Inverse block mask [L, L]. With window_size 1 this is the strictly causal mask."""
    pos = torch.arange(length, device=device)
    w = window_index(pos, window_size, offset)
    return w[None, :] < w[:, None]                                          # [Lq, Lk]


def depth_positions(length: int, window_size: int, offset: int, step: int,
                    device: torch.device | str = "cpu") -> Tensor:
    """Positions in [0, L) whose depth is `step` (the queries simulated at that stage-2 step)."""
    first = (offset + step - 1) % window_size
    return torch.arange(first, length, window_size, device=device)


def stage2_mask(query_positions: Tensor, length: int, predicted_positions: Tensor,
                window_size: int, offset: int) -> Tensor:
    """Mask [Lq, L + Lp] over the key banks [true states at 0..L-1 ; predicted states at
    predicted_positions]. A query sees true keys of earlier windows and predicted keys of its own
    window that come before it."""
    wq = window_index(query_positions, window_size, offset)[:, None]        # [Lq, 1]
    true_keys = torch.arange(length, device=query_positions.device)
    wt = window_index(true_keys, window_size, offset)[None, :]              # [1, L]
    wp = window_index(predicted_positions, window_size, offset)[None, :]    # [1, Lp]
    sees_true = wt < wq
    sees_pred = (wp == wq) & (predicted_positions[None, :] < query_positions[:, None])
    return torch.cat([sees_true, sees_pred], dim=1)                         # [Lq, L + Lp]


def render(mask: Tensor) -> str:
    """ASCII picture of a [Lq, Lk] mask, rows = queries ('x' visible, '.' hidden), for docs/tests."""
    return "\n".join("".join("x" if v else "." for v in row.tolist()) for row in mask)


def _check(window_size: int, offset: int) -> None:
    if window_size < 1:
        raise ValueError(f"window_size={window_size} must be >= 1")
    if not 0 <= offset < window_size:
        raise ValueError(f"offset={offset} must lie in 0..window_size-1 ({window_size - 1})")
