"""The Beagle drafter: one cross-attention block plus a SwiGLU MLP (docs/method.md §1).

Queries are the target's token embeddings; keys and values are target hidden states (true ones from
the store or the verifier, or the drafter's own predictions fed back). The block outputs ĥ_i, a draft
estimate of the target's last hidden state h_i, which the target's frozen LM head turns into logits
predicting t_{i+1}. Nothing here knows about data, masks or training.

    x_i  = Emb(t_i)
    u_i  = x_i + W_o · Attn(q = RMSNorm(x_i), k,v = RMSNorm_kv(H_vis))
    ĥ_i  = u_i + MLP(RMSNorm(u_i))
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beagle.target_facts import architecture_values


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


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of the drafter; every field is copied from the target so the frozen head fits."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Target layers whose states make a key (HF hidden_states indices, -1 = after the final norm, always
    # last). More than one: the keys of true positions come from a fusion of these layers (docs/training.md).
    key_layers: tuple[int, ...] = (-1,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_layers", tuple(int(layer) for layer in self.key_layers))
        if not self.key_layers or self.key_layers[-1] != -1 or len(set(self.key_layers)) != len(self.key_layers):
            raise ValueError(f"key_layers={list(self.key_layers)} must be distinct layers ending with -1 "
                             "(the state the LM head reads)")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; the target's head layout is invalid")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_architecture(cls, arch: dict[str, Any]) -> "DrafterConfig":
        """Build from a store's target["architecture"] or an HF `config.to_dict()` (read by target_facts)."""
        arch = architecture_values(arch)
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
                   if arch.get(k) is None]
        if missing:
            raise ValueError(f"target architecture lacks {missing}; re-extract the store with a "
                             "transformers config that has them")
        rope_theta = arch["rope_theta"]  # None: the target has no RoPE (GPT-2); the drafter still needs one
        return cls(
            hidden_size=int(arch["hidden_size"]),
            num_attention_heads=int(arch["num_attention_heads"]),
            num_key_value_heads=int(arch["num_key_value_heads"]),
            head_dim=int(arch["head_dim"]),
            intermediate_size=int(arch["intermediate_size"]),
            vocab_size=int(arch["vocab_size"]),
            rope_theta=10000.0 if rope_theta is None else float(rope_theta),
            rms_norm_eps=float(arch.get("rms_norm_eps") or 1e-6),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["key_layers"] = list(self.key_layers)
        return d

    @property
    def fused(self) -> bool:
        return len(self.key_layers) > 1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DrafterConfig keys {unknown}; expected a subset of {sorted(names)}")
        return cls(**d)


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


def register_frozen_head(module: nn.Module, config: DrafterConfig, embed_tokens: Tensor, lm_head: Tensor) -> None:
    """Attach the target's embedding and LM head ([V, d] each) as frozen non-persistent buffers:
    `.to()` moves them, `state_dict()` (the exported weights) leaves them out.

    They are the caller's tensors, not copies: at eval time the drafter reads the target's own embedding and
    head (a 262k x 4096 head is 2 GB in bf16; a copy of each would cost 4 GB of GPU memory). Nothing writes
    to them in place; `.to()` to another dtype or device makes the drafter its own converted copy."""
    expected = (config.vocab_size, config.hidden_size)
    for name, t in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected} "
                             "(vocab_size, hidden_size) from the drafter config")
    module.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
    module.register_buffer("lm_head", lm_head.detach(), persistent=False)


class LayerFusion(nn.Module):
    """Keys from several target layers: their states, concatenated, mapped by one linear map to width d.

    It starts as "take the last layer": the last layer's block of the map is the identity and the others
    are zero, so a fused drafter begins exactly where a last-layer drafter does and learns what the other
    layers add. The drafter's own predicted states are last-layer estimates and skip the map."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(len(config.key_layers) * config.hidden_size, config.hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d = self.config.hidden_size
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, -d:] = torch.eye(d)

    def forward(self, states: Tensor) -> Tensor:
        """[..., n_layers * d] (in key_layers order) -> [..., d]."""
        expected = self.proj.in_features
        if states.shape[-1] != expected:
            raise ValueError(f"the drafter fuses layers {list(self.config.key_layers)} ({expected} values per "
                             f"position) but got states of width {states.shape[-1]}; feed it the states of "
                             "exactly those layers, concatenated")
        return self.proj(states)


def fuse_key_states(module: nn.Module, states: Tensor) -> Tensor:
    """True key states of a drafter: [..., n_layers * d] fused to [..., d]; [..., d] as is when unfused."""
    fusion = getattr(module, "layer_fusion", None)
    return states if fusion is None else fusion(states)


def restrict_loss_vocabulary(module: nn.Module, tokens: Tensor) -> None:
    """Train the token loss over `tokens` [N] (a reduced draft vocabulary) instead of the full LM head.

    Why: on a CPU the [N, V] logits of the soft cross-entropy are most of a training step (V = 49k for
    SmolLM2); scoring the draft vocabulary that decoding uses anyway makes a step several times cheaper
    and matches training to drafting. Both distributions are renormalised over the subset."""
    module.register_buffer("loss_head", module.lm_head[tokens.to(module.lm_head.device)].contiguous(),
                           persistent=False)  # [N, d]


def loss_head(module: nn.Module) -> Tensor:
    """The LM-head rows the token loss scores: the reduced vocabulary when set, else the full head."""
    head = getattr(module, "loss_head", None)
    return module.lm_head if head is None else head


class BeagleDrafter(nn.Module):
    """The drafter block. Embedding and LM head are frozen non-persistent buffers:
    `.to()` moves them, `state_dict()` (the exported weights) leaves them out."""

    def __init__(self, config: DrafterConfig, embed_tokens: Tensor, lm_head: Tensor) -> None:
        super().__init__()
        self.config = c = config
        register_frozen_head(self, config, embed_tokens, lm_head)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)       # on queries (embeddings)
        self.kv_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)          # on key/value states [ours]
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.layer_fusion = LayerFusion(c) if c.fused else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        if self.layer_fusion is not None:
            self.layer_fusion.reset_parameters()

    def project_keys(self, states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Target (or predicted) states [B, Lk, d] at positions [B, Lk] -> k, v [B, H_kv, Lk, hd].

        Keys are computed once per state and reused by every query (a KV cache at draft time)."""
        B, Lk, _ = states.shape
        c = self.config
        s = self.kv_norm(states)
        k = self.k_proj(s).view(B, Lk, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(s).view(B, Lk, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rotary(k, positions, c.rope_theta), v

    def project_true_keys(self, states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys of true target states [B, Lk, n_layers * d] (the key layers, concatenated): fused, then
        projected like any state."""
        return self.project_keys(fuse_key_states(self, states), positions)

    def forward_hidden(self, input_ids: Tensor, positions: Tensor, k: Tensor, v: Tensor,
                       attn_mask: Tensor) -> Tensor:
        """Draft states ĥ [B, Lq, d] for tokens input_ids [B, Lq] at positions [B, Lq].

        k, v: [B, H_kv, Lk, hd] from `project_keys`; attn_mask [B, 1, Lq, Lk], True = visible.
        A query that sees no key gets a zero attention output (finite, no NaN)."""
        c = self.config
        B, Lq = input_ids.shape
        # In the weights' dtype: a bf16-kept frozen embedding must not start a bf16 residual stream in training
        x = F.embedding(input_ids, self.embed_tokens).to(self.q_proj.weight.dtype)   # [B, Lq, d]
        q = self.q_proj(self.input_norm(x)).view(B, Lq, c.num_attention_heads, c.head_dim)
        q = rotary(q.transpose(1, 2), positions, c.rope_theta)              # [B, H, Lq, hd]
        has_key = attn_mask.any(dim=-1, keepdim=True)                       # [B, 1, Lq, 1]
        # An all-hidden row would give softmax over nothing (NaN): let it see everything, then zero it.
        mask = attn_mask | ~has_key
        if k.dtype != q.dtype:  # autocast leaves projections in bf16 but q may come out in fp32
            k, v = k.to(q.dtype), v.to(q.dtype)
        attn = grouped_attention(q, k, v, mask) * has_key.to(q.dtype)       # [B, H, Lq, hd]
        u = x + self.o_proj(attn.transpose(1, 2).reshape(B, Lq, c.num_attention_heads * c.head_dim))
        return u + self.mlp(self.post_attention_norm(u))                    # [B, Lq, d]

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft states [B, Lq, d] -> logits [B, Lq, V] through the target's frozen LM head."""
        return hidden @ self.lm_head.to(hidden.dtype).T

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The weights a run exports: everything but the frozen embedding and LM head."""
        return dict(self.state_dict())
