"""Losses (docs/method.md §4): soft cross-entropy against the target's distribution, computed in vocabulary
chunks so the [N, V] logits are never held in memory, plus SmoothL1 regression of the states.

Why a custom autograd function: with V ~ 50k the logits dominate both time and memory. The loss
-Σ_v p_v log q_v = lse(z) - Σ_v p_v z_v needs only each chunk's log-sum-exps and sums, and its gradient
(q - p) @ W can be recomputed chunk by chunk in backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype the head matmuls run in: autocast's (bf16 training) where it is on, else x's own.

    Chosen explicitly and saved for backward, which runs outside autocast on every device type."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


# Vocabulary rows per soft cross-entropy chunk, by device type. On a CPU [N, 1024] blocks stay in cache: bf16
# training ran 8,526 tokens/s against 5,366 at 8,192 (bench/train.py, 2 AMX cores); a GPU prefers fewer, larger
# kernels.
GPU_VOCAB_CHUNK = 8192
DEFAULT_VOCAB_CHUNK = {"cpu": 1024, "cuda": GPU_VOCAB_CHUNK}


def default_vocab_chunk(device: torch.device | None) -> int:
    """The chunk `train` uses on `device` unless told `--vocab-chunk` (CPU when None)."""
    return DEFAULT_VOCAB_CHUNK.get("cpu" if device is None else device.type, GPU_VOCAB_CHUNK)


def _chunk_softmax(rows: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """softmax over one vocabulary chunk of the logits rows @ weight.T, with its max, argmax and lse.

    rows [N, d], weight [C, d], both in the matmul dtype -> (logits [N, C], softmax [N, C] in that dtype,
    max [N] fp32, argmax [N], lse [N] fp32). One fused softmax kernel instead of separate max/sub/exp/sum
    passes; the lse is read off it: the softmax at the argmax is exp(max - lse)."""
    logits = rows @ weight.T                                                           # [N, C]
    probs = torch.softmax(logits, dim=1)                                               # [N, C]
    top, arg = logits.max(dim=1)                                                       # [N]
    lse = top.float() - torch.log(probs.gather(1, arg[:, None])[:, 0].float())         # [N]
    return logits, probs, top.float(), arg, lse


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    """loss = lse(z) - sum_v p_v z_v with z = LMHead(hidden), p = softmax(LMHead(target)), chunk by chunk.

    Each chunk's softmax is normalised within the chunk; the chunks are joined by their lse (the weight of
    chunk c in the whole softmax is exp(lse_c - lse)). Backward recomputes each chunk's two softmaxes:
    d loss / d hidden = sum_c (q_c exp(lse_q,c - lse_q) - p_c exp(lse_t,c - lse_t)) @ W_c. Chunks of ~1,024
    rows keep the [N, C] blocks in cache on a CPU (docs/training.md)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, target_hidden: Tensor, weight: Tensor, chunk: int):  # type: ignore[override]
        mm_dtype = _matmul_dtype(hidden)
        hidden_mm, target_mm = hidden.to(mm_dtype), target_hidden.to(mm_dtype)          # [N, d] each
        lse_q, lse_t, mean_z, arg_q, arg_t, top_q, top_t = [], [], [], [], [], [], []
        for start in range(0, weight.shape[0], chunk):
            w = weight[start:start + chunk].to(mm_dtype)                               # [C, d]; no copy if already
            z, _, ztop, zarg, zlse = _chunk_softmax(hidden_mm, w)
            _, p, ttop, targ, tlse = _chunk_softmax(target_mm, w)
            mean_z.append((p * z).sum(dim=1, dtype=torch.float32))                     # [N]: E_p_c[z]
            lse_q.append(zlse)
            lse_t.append(tlse)
            top_q.append(ztop)
            top_t.append(ttop)
            arg_q.append(zarg + start)
            arg_t.append(targ + start)
        lse_q_c, lse_t_c = torch.stack(lse_q, dim=1), torch.stack(lse_t, dim=1)        # [N, chunks]
        total_q, total_t = torch.logsumexp(lse_q_c, dim=1), torch.logsumexp(lse_t_c, dim=1)  # [N]
        log_share_q, log_share_t = lse_q_c - total_q[:, None], lse_t_c - total_t[:, None]    # [N, chunks]
        loss = total_q - (log_share_t.exp() * torch.stack(mean_z, dim=1)).sum(dim=1)   # [N]
        ctx.save_for_backward(hidden, target_hidden, weight, log_share_q, log_share_t)
        ctx.chunk, ctx.mm_dtype = chunk, mm_dtype
        draft_argmax, target_argmax = _first_argmax(top_q, arg_q), _first_argmax(top_t, arg_t)  # [N] each
        ctx.mark_non_differentiable(draft_argmax, target_argmax)
        return loss, draft_argmax, target_argmax

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _g1, _g2):  # type: ignore[override]
        hidden, target_hidden, weight, log_share_q, log_share_t = ctx.saved_tensors
        mm_dtype = ctx.mm_dtype
        hidden_mm, target_mm = hidden.to(mm_dtype), target_hidden.to(mm_dtype)          # [N, d] each
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for index, start in enumerate(range(0, weight.shape[0], ctx.chunk)):
            w = weight[start:start + ctx.chunk].to(mm_dtype)                           # [C, d]
            q = torch.softmax(hidden_mm @ w.T, dim=1)                                  # [N, C]
            p = torch.softmax(target_mm @ w.T, dim=1)
            scale_q = (grad_loss * log_share_q[:, index].exp()).to(mm_dtype)[:, None]  # [N, 1]
            scale_t = (grad_loss * log_share_t[:, index].exp()).to(mm_dtype)[:, None]
            grad_hidden += (q * scale_q - p * scale_t) @ w
        return grad_hidden.to(hidden.dtype), None, None, None


def _first_argmax(chunk_tops: list[Tensor], chunk_args: list[Tensor]) -> Tensor:
    """The vocabulary argmax [N] from each chunk's top value and argmax (ties: the earlier chunk, as
    torch.argmax over the whole row would)."""
    best = torch.stack(chunk_tops, dim=1).argmax(dim=1, keepdim=True)                  # [N, 1]
    return torch.stack(chunk_args, dim=1).gather(1, best)[:, 0]


def soft_cross_entropy(hidden: Tensor, target_hidden: Tensor, lm_head: Tensor,
                       chunk_size: int = GPU_VOCAB_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row soft CE between LMHead(hidden) and softmax(LMHead(target_hidden)).

    hidden, target_hidden [N, d]; lm_head [V, d] (frozen). Returns (loss [N], draft argmax [N],
    target argmax [N]); only `hidden` receives a gradient."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    return _ChunkedSoftCrossEntropy.apply(hidden, target_hidden.detach(), lm_head.detach(), chunk_size)


def regression_loss(hidden: Tensor, target_hidden: Tensor) -> Tensor:
    """SmoothL1(ĥ, h) averaged over the width: [N, d] x2 -> [N]."""
    return F.smooth_l1_loss(hidden.float(), target_hidden.float(), reduction="none").mean(-1)


@dataclass
class LossResult:
    loss: Tensor                # what is optimised: token_loss + regression_weight * regression_loss (scaled)
    token_loss: Tensor
    regression_loss: Tensor
    correct: Tensor             # [k] long, per depth 1..k: draft top-1 == target top-1 on loss rows
    count: Tensor               # [k] long, per depth: loss rows


def beta_weights(simulation_steps: int) -> list[float]:
    """β_j = s - j + 1 normalised by their sum (docs/method.md §4.3): earlier depths matter more."""
    betas = [float(simulation_steps - j + 1) for j in range(1, simulation_steps + 1)]
    total = sum(betas)
    return [b / total for b in betas]


@dataclass
class DepthSums:
    """Per-depth sums over a set of rows ([k] tensors each), before normalisation."""

    token: Tensor               # Σ weight · soft CE
    regression: Tensor          # Σ weight · SmoothL1
    weight: Tensor              # Σ weight (this rank's rows only)
    correct: Tensor             # draft top-1 == target top-1, long
    count: Tensor               # rows, long


def depth_sums(hidden: Tensor, target_hidden: Tensor, weight: Tensor, depth: Tensor, lm_head: Tensor, *,
               num_depths: int, chunk_size: int, compact: bool = True) -> DepthSums:
    """Sum the losses of rows hidden/target_hidden [N, d] with weight [N] (0 drops a row) per depth [N] in 1..k.

    compact: drop the weight-0 rows before the LM head (boolean indexing: a host synchronisation, free on
    a CPU); else every row goes through it and dropped rows are zeroed, with no synchronisation (what an
    accelerator wants: its queue never waits for the host)."""
    keep = weight > 0                                                                   # [N]
    if compact:
        hidden, target_hidden, weight, depth = hidden[keep], target_hidden[keep], weight[keep], depth[keep]
        keep = torch.ones_like(weight, dtype=torch.bool)
    ce, arg_q, arg_t = soft_cross_entropy(hidden, target_hidden, lm_head, chunk_size)  # [N] each
    reg = regression_loss(hidden, target_hidden)                                        # [N]
    zero = torch.zeros((), device=hidden.device)
    index = depth - 1
    zeros = torch.zeros(num_depths, device=hidden.device)
    counts = torch.zeros(num_depths, dtype=torch.long, device=hidden.device)
    return DepthSums(
        token=zeros.index_add(0, index, torch.where(keep, ce * weight, zero)),
        regression=zeros.index_add(0, index, torch.where(keep, reg * weight, zero)),
        weight=zeros.index_add(0, index, weight.float()),
        correct=counts.index_add(0, index, ((arg_q == arg_t) & keep).long()),
        count=counts.index_add(0, index, keep.long()))


def depth_scale(global_weight: Tensor, depth_weights: list[float] | None) -> Tensor:
    """[k] factors turning per-depth sums into the loss, from the global batch's per-depth weight sums.

    Stage 1 (depth_weights None): the weighted mean over all rows. Stage 2: each depth's weighted mean
    times its normalised β_j; a depth without rows in the batch contributes nothing."""
    if depth_weights is None:
        return torch.ones_like(global_weight) / global_weight.sum().clamp_min(1e-12)
    betas = depth_weights + [0.0] * (global_weight.numel() - len(depth_weights))
    return torch.tensor(betas, device=global_weight.device) / global_weight.clamp_min(1e-12)


@dataclass
class LossSums:
    """What a stage's loss function returns: per-depth sums over this worker's rows, and how they
    become the loss.

    Why sums and not a loss: the loss is a weighted mean over the *global* batch, whose row weights only
    the trainer can gather (an all-reduce under data parallelism). Loss functions stay free of
    communication; `finish` normalises in one place."""

    sums: DepthSums
    depth_weights: list[float] | None   # None: one weighted mean over all rows; else β_j per depth
    regression_weight: float
    scale: float = 1.0                  # a constant factor on the optimised loss (EAGLE-2's 0.1)

    def finish(self, total: Callable[[Tensor], Tensor] | None = None) -> LossResult:
        """The loss, normalised by the row weights per depth; `total` sums them over workers
        (`beagle.distributed.global_sum` under DDP; one process needs none)."""
        weight = self.sums.weight if total is None else total(self.sums.weight)
        scale = depth_scale(weight, self.depth_weights)                                  # [k]
        token, regression = (self.sums.token * scale).sum(), (self.sums.regression * scale).sum()
        loss = self.scale * (token + self.regression_weight * regression)
        return LossResult(loss, token, regression, self.sums.correct, self.sums.count)


def drafter_loss_sums(hidden: Tensor, target_hidden: Tensor, weight: Tensor, depth: Tensor, lm_head: Tensor, *,
                      num_depths: int, depth_weights: list[float] | None, regression_weight: float,
                      chunk_size: int, scale: float = 1.0, compact: bool = True) -> LossSums:
    """Loss sums over rows: hidden/target_hidden [N, d], weight [N] (0 drops a row), depth [N] in 1..k,
    to be normalised as `depth_scale` says."""
    sums = depth_sums(hidden, target_hidden, weight, depth, lm_head, num_depths=num_depths, chunk_size=chunk_size,
                      compact=compact)
    return LossSums(sums, depth_weights, regression_weight, scale)
