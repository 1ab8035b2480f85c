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

from beagle.block import RMSNorm, SwiGLU, add_block_layers, attend_and_mix, project_kv, project_queries, rotary
from beagle.registry import RESIDUALS
from beagle.target_facts import architecture_values



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
    # Target layers whose states make a key (HF hidden_states indices). Residual "embedding" (docs/method.md
    # §1): -1 = after the final norm, always last; more than one: the keys of true positions come from a fusion
    # of these layers (docs/training.md). Residual "state" (docs/method.md §9): the residual stream entering
    # decoder layers (0..n-1, ascending), an engine's aux hidden states, always fused (EAGLE-3's fc).
    key_layers: tuple[int, ...] = (-1,)
    # What the block's residual stream starts from: the query token's embedding (Beagle as in the paper) or
    # the previous position's state (the engine form, a special case of an EAGLE-3 layer).
    residual: str = "embedding"
    # State residual only: the queries also read the previous state (EAGLE-3's q over [emb; state] in full)
    query_state: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_layers", tuple(int(layer) for layer in self.key_layers))
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual={self.residual!r} must be one of {list(RESIDUALS)}")
        distinct = bool(self.key_layers) and len(set(self.key_layers)) == len(self.key_layers)
        if self.query_state and self.residual != "state":
            raise ValueError("query_state (queries that also read the previous state) needs residual='state'")
        if self.residual == "state":
            if not distinct or min(self.key_layers) < 0 or list(self.key_layers) != sorted(self.key_layers):
                raise ValueError(f"key_layers={list(self.key_layers)}: a state-residual drafter reads the residual "
                                 "stream entering decoder layers: distinct layers 0..n-1 in ascending order "
                                 "(an engine concatenates them in that order), not -1")
        elif not distinct or self.key_layers[-1] != -1:
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
        """True keys pass through a fusion map (`LayerFusion`): several layers, or any state-residual drafter."""
        return len(self.key_layers) > 1 or self.residual == "state"

    @property
    def reads_key_states(self) -> bool:
        """Whether its true keys are made of `Batch.key_states` (the key layers) rather than `Batch.hidden`."""
        return self.key_layers != (-1,)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown DrafterConfig keys {unknown}; expected a subset of {sorted(names)}")
        return cls(**d)


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
    fusion = module.layer_fusion  # every form has one (None: keys read one layer), beagle/registry.py's Drafter
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

    drafter_type = "beagle"
    carries_state = False  # the residual stream starts from the query's embedding, not a fed-in state
    draft_columns = None   # scores the whole vocabulary (a reduced one is a view, beagle/decoding/draft_vocab.py)

    def __init__(self, config: DrafterConfig, embed_tokens: Tensor, lm_head: Tensor) -> None:
        super().__init__()
        if config.residual != "embedding":
            raise ValueError(f"BeagleDrafter is the embedding-residual form; residual={config.residual!r} is "
                             "beagle.state_beagle.StateBeagleDrafter (beagle/registry.py picks it)")
        self.config = c = config
        register_frozen_head(self, config, embed_tokens, lm_head)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)       # on queries (embeddings)
        self.kv_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)          # on key/value states [ours]
        add_block_layers(self, c)                                      # q/k/v/o, post_attention_norm, mlp
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
        return project_kv(self, self.kv_norm(states), positions)

    def project_true_keys(self, states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys of true target states [B, Lk, n_layers * d] (the key layers, concatenated): fused, then
        projected like any state."""
        return self.project_keys(fuse_key_states(self, states), positions)

    def forward_hidden(self, input_ids: Tensor, positions: Tensor, k: Tensor, v: Tensor,
                       attn_mask: Tensor, residual: Tensor | None = None) -> Tensor:
        """Draft states ĥ [B, Lq, d] for tokens input_ids [B, Lq] at positions [B, Lq].

        k, v: [B, H_kv, Lk, hd] from `project_keys`; attn_mask [B, 1, Lq, Lk], True = visible.
        `residual` is for state-carrying forms and must be None here. A query that sees no key gets a
        zero attention output (finite, no NaN)."""
        if residual is not None:
            raise ValueError("the embedding-residual Beagle starts its residual from the query embedding")
        # In the weights' dtype: a bf16-kept frozen embedding must not start a bf16 residual stream in training
        x = F.embedding(input_ids, self.embed_tokens).to(self.q_proj.weight.dtype)   # [B, Lq, d]
        q = project_queries(self, self.input_norm(x), positions)            # [B, H, Lq, hd]
        return attend_and_mix(self, q, k, v, attn_mask, x)                  # [B, Lq, d]

    def head_input(self, hidden: Tensor) -> Tensor:
        """What the LM head reads of a draft state: ĥ itself (it estimates the post-norm h)."""
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft states [B, Lq, d] -> logits [B, Lq, V] through the target's frozen LM head."""
        return self.head_input(hidden) @ self.lm_head.to(hidden.dtype).T
