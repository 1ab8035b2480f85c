"""Beagle in engine form: the residual stream carries the previous position's state (docs/method.md §9).

    s_j     = fc([a_j^(l1), ..., a_j^(lm)])                  # fused true state: the target's residual stream
                                                              # entering decoder layers l1 < ... < lm (vLLM's aux
                                                              # hidden states), or the drafter's own output o_j
    u_i     = s_{i-1} + W_o · Attn(q = RMSNorm_q(Emb(t_i)),    # queries: token embeddings only (RoPE at i-1)
                                   k, v = RMSNorm_kv(S_visible))  # keys/values: states only
    o_i     = u_i + MLP(RMSNorm(u_i))                         # fed back as s_i when drafting deeper
    logits_i = LMHead(RMSNorm_out(o_i))                       # predicts t_{i+1}

Read at row r = i - 1 this is exactly one EAGLE-3 layer (vLLM's `llama_eagle3.py`, speculators' `Eagle3DraftModel`,
SpecForge's `midlayer`) whose q/k/v read [RMSNorm(emb), RMSNorm(s)] with the state half of q and the embedding
half of k and v zero: an EAGLE-3 engine serves it unchanged (beagle/engine_export.py). What stays Beagle:
keys and values are target states only, there is no fusion of token and state, and the two stages train it.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from beagle.block import RMSNorm, add_block_layers, attend_and_mix, project_kv, rotate_queries
from beagle.model import DrafterConfig, LayerFusion, register_frozen_head

DRAFTER_TYPE = "beagle-state"


class StateBeagleDrafter(nn.Module):
    """The engine-form Beagle block. Embedding and LM head are frozen non-persistent buffers, as in
    BeagleDrafter; `layer_fusion` is EAGLE-3's `fc` (identity on the deepest key layer at start)."""

    drafter_type = DRAFTER_TYPE
    carries_state = True
    draft_columns = None

    def __init__(self, config: DrafterConfig, embed_tokens: Tensor, lm_head: Tensor) -> None:
        super().__init__()
        if config.residual != "state":
            raise ValueError(f"StateBeagleDrafter needs residual='state', got {config.residual!r}")
        self.config = c = config
        register_frozen_head(self, config, embed_tokens, lm_head)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)       # on queries (embeddings): input_layernorm
        self.kv_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)          # on key/value states: hidden_norm
        add_block_layers(self, c)                                      # q/k/v/o, post_attention_norm, mlp
        self.output_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)      # before the LM head: EAGLE-3's norm
        self.layer_fusion = LayerFusion(c)                             # aux layers -> s: EAGLE-3's fc
        # --query-state: queries also read RMSNorm_kv(s_{i-1}), the state half of EAGLE-3's q_proj
        self.q_state_proj = (nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
                             if c.query_state else None)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        self.layer_fusion.reset_parameters()

    def fuse_true_states(self, states: Tensor) -> Tensor:
        """True key-layer states [..., n_layers * d] (ascending layers, concatenated) -> s [..., d]."""
        return self.layer_fusion(states)

    def project_keys(self, states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """States s [B, Lk, d] (fused true ones or the drafter's outputs) at positions [B, Lk] -> k, v."""
        return project_kv(self, self.kv_norm(states), positions)

    def project_true_keys(self, states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.project_keys(self.fuse_true_states(states), positions)

    def forward_hidden(self, input_ids: Tensor, positions: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor,
                       residual: Tensor | None = None) -> Tensor:
        """Outputs o [B, Lq, d] for tokens input_ids [B, Lq] at positions [B, Lq] whose residual streams start
        from `residual` [B, Lq, d] (the state of position p - 1). k, v: [B, H_kv, Lk, hd]; attn_mask
        [B, 1, Lq, Lk], True = visible.

        The query of token t_p is rotated at p - 1: in the engine its row is the previous position's (row r
        carries t_{r+1} and s_r), and only relative angles count, so keys keep their own positions."""
        if residual is None:
            raise ValueError("the state-residual Beagle needs the previous position's state as its residual")
        x = F.embedding(input_ids, self.embed_tokens).to(self.q_proj.weight.dtype)   # [B, Lq, d]
        residual = residual.to(x.dtype)
        q = self.q_proj(self.input_norm(x))                                 # [B, Lq, H * hd]
        if self.q_state_proj is not None:
            q = q + self.q_state_proj(self.kv_norm(residual))
        q = rotate_queries(self, q, positions - 1)                          # [B, H, Lq, hd]
        return attend_and_mix(self, q, k, v, attn_mask, residual)

    def head_input(self, hidden: Tensor) -> Tensor:
        """What the LM head reads of an output o: RMSNorm_out(o), the estimate of the target's post-norm h."""
        return self.output_norm(hidden)

    def logits(self, hidden: Tensor) -> Tensor:
        """Outputs [B, Lq, d] -> logits [B, Lq, V] through the target's frozen LM head."""
        return self.head_input(hidden) @ self.lm_head.to(hidden.dtype).T
