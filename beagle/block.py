"""The one attention + MLP block every drafter form is built from (docs/method.md §1, §7, §9).

Beagle (both residual forms) and the EAGLE-2 baseline differ in what their queries, keys, values and
residual stream are made of, never in the block itself: RoPE'd grouped-query attention, an output
projection added to a residual, then a SwiGLU MLP behind an RMSNorm. Parameter names are those of a Llama
decoder layer (`q_proj` ... `mlp.down_proj`, `post_attention_norm`) and are registered on the drafter itself,
so exported weights keep the names they always had and map one to one onto an engine's layer
(beagle/engine_export.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _sdpa_has_gqa() -> bool:
    """torch >= 2.5 broadcasts KV heads itself; older ones need repeat_interleave."""
    doc = F.scaled_dot_product_attention.__doc__ or ""
    return "enable_gqa" in doc.split("->")[0]


_SDPA_HAS_GQA = _sdpa_has_gqa()


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, expand: bool | None = None) -> Tensor:
    """Masked SDPA of q [B, H, Lq, hd] over k, v [B, H_kv, Lk, hd] (H a multiple of H_kv), mask
    [B or 1, 1, Lq, Lk] (True = visible) -> [B, H, Lq, hd].

    `enable_gqa` broadcasts the KV heads without a copy, but on CUDA a masked SDPA with it runs only in the
    math kernel (fp32 [B, H, Lq, Lk] scores); there the KV heads are expanded instead, which the
    memory-efficient kernel takes with a mask. `expand` None: decide by device (tests force either)."""
    groups = q.shape[1] // k.shape[1]
    if expand is None:
        expand = q.device.type != "cpu" or not _SDPA_HAS_GQA
    if groups > 1 and expand:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)    # [B, H, Lk, hd]
    elif groups > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class RMSNorm(nn.Module):
    """Llama-style RMSNorm, computed in fp32 for stability under bf16 autocast."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def rotary(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Apply RoPE (HF Llama's rotate-half convention) to x [B, H, L, hd] at positions [B, L]."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    angles = positions.to(torch.float32)[..., None] * inv_freq          # [B, L, hd/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None]                  # [B, 1, L, hd]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def add_block_layers(module: nn.Module, config) -> None:
    """Register the block's layers on `module`, in this order (the order `reset_parameters` draws them in):
    q/k/v/o projections, the post-attention norm and the MLP. `config` is a DrafterConfig."""
    c = config
    module.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
    module.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
    module.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
    module.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
    module.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    module.mlp = SwiGLU(c.hidden_size, c.intermediate_size)


def project_kv(module: nn.Module, states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Normalised states [B, L, d] at positions [B, L] -> k (RoPE'd), v [B, H_kv, L, hd]."""
    B, L, _ = states.shape
    c = module.config
    k = module.k_proj(states).view(B, L, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    v = module.v_proj(states).view(B, L, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    return rotary(k, positions, c.rope_theta), v


def project_queries(module: nn.Module, x: Tensor, positions: Tensor) -> Tensor:
    """Query inputs [B, Lq, d] at RoPE positions [B, Lq] -> q [B, H, Lq, hd]."""
    return rotate_queries(module, module.q_proj(x), positions)


def rotate_queries(module: nn.Module, q: Tensor, positions: Tensor) -> Tensor:
    """Projected queries [B, Lq, H * hd] at RoPE positions [B, Lq] -> q [B, H, Lq, hd]."""
    B, Lq, _ = q.shape
    c = module.config
    q = q.view(B, Lq, c.num_attention_heads, c.head_dim)
    return rotary(q.transpose(1, 2), positions, c.rope_theta)


def attend_and_mix(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, residual: Tensor) -> Tensor:
    """The block after its projections: masked attention of q [B, H, Lq, hd] over k, v [B, H_kv, Lk, hd]
    (attn_mask [B, 1, Lq, Lk], True = visible), added to `residual` [B, Lq, d], then the MLP -> [B, Lq, d].

    A query that sees no key would take a softmax over nothing (NaN): its row attends to everything and
    its attention output is multiplied by zero, so it stays finite (the loss gives such rows weight 0)."""
    c = module.config
    B, Lq, _ = residual.shape
    has_key = attn_mask.any(dim=-1, keepdim=True)                       # [B, 1, Lq, 1]
    mask = attn_mask | ~has_key
    if k.dtype != q.dtype:  # autocast leaves projections in bf16 but q may come out in fp32
        k, v = k.to(q.dtype), v.to(q.dtype)
    attn = grouped_attention(q, k, v, mask) * has_key.to(q.dtype)       # [B, H, Lq, hd]
    u = residual + module.o_proj(attn.transpose(1, 2).reshape(B, Lq, c.num_attention_heads * c.head_dim))
    return u + module.mlp(module.post_attention_norm(u))                # [B, Lq, d]
