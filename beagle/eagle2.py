"""The EAGLE-2 baseline drafter (docs/method.md §7), trained by our trainer from our store for side-by-side figures.

    z_p   = fc([Emb(t_p), h̃_{p-1}])                     # Linear(2d -> d): token fused with the PREVIOUS state
    u_p   = z_p + W_o · SelfAttn(z_{≤p})                   # no input norm on this (first) layer, as EAGLE
    ĥ_p   = u_p + MLP(RMSNorm(u_p))                        # draft estimate of h_p; LMHead(ĥ_p) predicts t_{p+1}

Indexing is Beagle's (docs/method.md §1): row p carries token t_p and is trained to produce h_p, so both drafters
share the loss code and the loss index of docs/method.md §4.1 (weight loss_mask[p+1]). EAGLE writes the same thing
as fc([Emb(t_{i+1}), f_i]) -> f_{i+1}; RoPE only sees relative positions, so the shift is immaterial.
Row 0 has no previous state: it is neither a query in the loss nor a key.

Differences from Beagle that the figures compare: the drafter must be fed its own predicted state to go
deeper (EAGLE-3 style test-time feedback, not trained here: EAGLE-2 trains teacher-forced only), it
attends over fused (token, state) keys, and its noise is uniform (EAGLE: U(-w/2, w/2), w = noise_std).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beagle.block import add_block_layers, attend_and_mix, project_kv, project_queries
from beagle.data import Batch
from beagle.losses import LossSums, drafter_loss_sums
from beagle.model import DrafterConfig, LayerFusion, fuse_key_states, loss_head, register_frozen_head
from beagle.offline_acceptance import top1_tokens

DRAFTER_TYPE = "eagle2"
# EAGLE's loss is 1.0·SmoothL1 + 0.1·CE; our losses are CE + regression_weight·SmoothL1 (10 by default).
LOSS_SCALE = 0.1


class Eagle2Drafter(nn.Module):
    """fc + one Llama decoder layer. Embedding and LM head are frozen non-persistent buffers, as in
    BeagleDrafter: `state_dict()` (the export) holds only the trained weights."""

    drafter_type = DRAFTER_TYPE
    carries_state = True  # each query fuses its parent's state (docs/method.md §7)
    draft_columns = None

    def __init__(self, config: DrafterConfig, embed_tokens: Tensor, lm_head: Tensor) -> None:
        super().__init__()
        self.config = c = config
        register_frozen_head(self, config, embed_tokens, lm_head)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        add_block_layers(self, c)  # q/k/v/o, post_attention_norm, mlp (beagle/block.py)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # EAGLE-3 style input: true states are a fusion of several target layers (its own predicted
        # states deeper in a draft enter where the fused vector would be).
        self.layer_fusion = LayerFusion(c) if c.fused else None

    def fuse(self, tokens: Tensor, previous_states: Tensor) -> Tensor:
        """z = fc([Emb(t_p), h_{p-1}]): tokens [B, L], previous_states [B, L, d] -> [B, L, d]."""
        x = F.embedding(tokens, self.embed_tokens).to(previous_states.dtype)
        return self.fc(torch.cat([x, previous_states], dim=-1))

    def project_fused(self, z: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Fused inputs [B, L, d] at positions [B, L] -> k, v [B, H_kv, L, hd] (RoPE on k)."""
        return project_kv(self, z, positions)

    def attend(self, z: Tensor, positions: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor) -> Tensor:
        """Queries from fused inputs z [B, Lq, d] over k, v [B, H_kv, Lk, hd]; attn_mask [B, 1, Lq, Lk]
        (True = visible) -> draft states [B, Lq, d]. A row with no visible key gets zero attention."""
        return attend_and_mix(self, project_queries(self, z, positions), k, v, attn_mask, z)

    def forward_sequence(self, input_ids: Tensor, states: Tensor, lengths: Tensor) -> Tensor:
        """Teacher-forced pass: row p fuses t_p with the (noised) true state h_{p-1} and attends causally
        (itself included) over rows 1..p. input_ids [B, L], states [B, L, d] -> draft states [B, L, d]."""
        B, L, d = states.shape
        dev = states.device
        previous = torch.cat([states.new_zeros(B, 1, d), states[:, :-1]], dim=1)      # [B, L, d]
        z = self.fuse(input_ids, previous)
        positions = torch.arange(L, device=dev).expand(B, L)
        k, v = self.project_fused(z, positions)
        mask = causal_mask(L, dev)[None, None] & (torch.arange(L, device=dev) < lengths[:, None])[:, None, None, :]
        return self.attend(z, positions, k, v, mask)

    def draft_step(self, tokens: Tensor, positions: Tensor, parent_states: Tensor, keys: Tensor,
                   values: Tensor, attn_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One drafting step for queries tokens [1, q] at positions [1, q] whose parent states (true h_n
        for the root, the parent's draft state deeper) are [1, q, d]. keys/values hold the fused keys of
        true positions and of drafted ancestors, attn_mask [1, 1, q, Lk]. Each query also sees its own
        fused key, which it returns as the key its descendants see.
        Returns (draft states [1, q, d], own keys, own values [1, H_kv, q, hd])."""
        z = self.fuse(tokens, parent_states)                                  # [1, q, d]
        own_k, own_v = self.project_fused(z, positions)
        q = tokens.shape[1]
        eye = torch.eye(q, dtype=torch.bool, device=tokens.device)[None, None]
        hidden = self.attend(z, positions, torch.cat([keys, own_k.to(keys.dtype)], dim=-2),
                             torch.cat([values, own_v.to(values.dtype)], dim=-2),
                             torch.cat([attn_mask, eye], dim=-1))
        return hidden, own_k, own_v

    def head_input(self, hidden: Tensor) -> Tensor:
        """What the LM head reads of a draft state: the state itself."""
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft states [B, Lq, d] -> logits [B, Lq, V] through the target's frozen LM head."""
        return self.head_input(hidden) @ self.lm_head.to(hidden.dtype).T


def causal_mask(length: int, device: torch.device | str = "cpu") -> Tensor:
    """[L, L] mask for rows 1..L-1: row p sees keys 1..p (itself included); row and key 0 are empty."""
    pos = torch.arange(length, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] >= 1) & (pos[:, None] >= 1)


class Eagle2KeyCache:
    """The EAGLE-2 drafter's cache at decoding time: fused keys z_p = fc([Emb(t_p), h_{p-1}]) for the
    committed positions, and the last true state h_n, which the next root fuses with its token.

    `append(states, positions, tokens)` takes what the target consumed and produced: t_a..t_b and
    h_a..h_b. Key p needs h_{p-1}, so the key of position a uses the state kept from the last call.
    Keys live in a preallocated buffer written in place (beagle/decoding/kv_cache.py)."""

    def __init__(self, drafter: Eagle2Drafter) -> None:
        from beagle.decoding.kv_cache import KeyValueBuffer

        self._drafter = drafter
        self.buffer = KeyValueBuffer()
        self.last_state: Tensor | None = None  # [d]
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def keys(self) -> Tensor | None:
        """[1, H_kv, n, hd] (a view; n = committed positions - 1), None before the first key."""
        return self.buffer.view()[0] if self.buffer.allocated else None

    @property
    def values(self) -> Tensor | None:
        return self.buffer.view()[1] if self.buffer.allocated else None

    def reserve(self, capacity: int) -> None:
        self.buffer.reserve(capacity)

    def append(self, states: Tensor, positions: Tensor, tokens: Tensor) -> None:
        """states [L, n_layers * d] (the key layers, concatenated), positions [L], tokens [L]."""
        states = fuse_key_states(self._drafter, states)                          # [L, d]
        previous = states[:-1]
        if self.last_state is not None:
            previous = torch.cat([self.last_state[None], previous])
        else:  # position 0 has no previous state: no key
            positions, tokens = positions[1:], tokens[1:]
        if positions.numel():
            z = self._drafter.fuse(tokens[None], previous[None])
            self.buffer.append(*self._drafter.project_fused(z, positions[None]))
        self.last_state = states[-1]
        self._length += states.shape[0]


def uniform_noise(states: Tensor, batch: Batch, width: float, generator: torch.Generator | None) -> Tensor:
    """EAGLE's feature noise: U(-width/2, width/2) added to every true state [B, L, d] of `batch`.

    Drawn through `Batch.noise`, so under DDP each row gets the noise a one-process run gives it."""
    if width <= 0:
        return states
    return states + (batch.noise(generator, draw=torch.rand) - 0.5) * width


def _row_weights(batch: Batch) -> Tensor:
    """[B, L] loss weight per row: row p predicts t_{p+1} (an assistant token); row 0 has no state."""
    B, L = batch.input_ids.shape
    weight = torch.zeros(B, L, device=batch.loss_mask.device)
    weight[:, 1:-1] = batch.loss_mask[:, 2:].float()
    return weight


def eagle2_weights(batch: Batch, offset: int, settings) -> Tensor:
    """[1] the summed row weights `eagle2_loss` normalises by (for gradient accumulation, as
    `beagle.stages.stage1_weights`)."""
    return _row_weights(batch).sum().reshape(1)


def eagle2_loss(model: Eagle2Drafter, batch: Batch, offset: int, settings, generator: torch.Generator | None = None
                ) -> LossSums:
    """The EAGLE-2 training loss, with the trainer's stage-loss signature (offset unused: no windows).

    LOSS_SCALE · (CE + regression_weight · SmoothL1) = 1.0·SmoothL1 + 0.1·CE at the default weight 10."""
    B, L, d = batch.hidden.shape
    true_states = fuse_key_states(model, batch.key_input(model.config.reads_key_states))                 # [B, L, d]
    states = uniform_noise(true_states, batch, settings.noise_std, generator)
    hidden = model.forward_sequence(batch.input_ids, states, batch.lengths)             # [B, L, d]
    weight = _row_weights(batch).to(hidden.device)
    depths = torch.ones(B * L, dtype=torch.long, device=hidden.device)
    return drafter_loss_sums(hidden.reshape(B * L, d), batch.hidden.reshape(B * L, d), weight.reshape(-1), depths,
                             loss_head(model), num_depths=1, depth_weights=None,
                             regression_weight=settings.regression_weight, chunk_size=settings.vocab_chunk,
                             scale=LOSS_SCALE, compact=settings.compact_rows)


def eagle2_chain_tokens(model: Eagle2Drafter, batch: Batch, depth: int, vocab: Tensor | None = None
                        ) -> dict[int, Tensor]:
    """Held-out τ's chains (beagle/offline_acceptance.py) for EAGLE-2, in `beagle_chain_tokens`' layout: at step j
    every row p drafts depth j for the root n = p - j."""
    B, L, d = batch.hidden.shape
    pos = torch.arange(L, device=batch.hidden.device)
    positions = pos.expand(B, L)
    true = fuse_key_states(model, batch.key_input(model.config.reads_key_states))                  # [B, L, d]
    previous = torch.cat([true.new_zeros(B, 1, d), true[:, :-1]], dim=1)
    true_z = model.fuse(batch.input_ids, previous)
    k0, v0 = model.project_fused(true_z, positions)
    keys, values = [k0], [v0]
    parent = previous
    per_step = []
    for step in range(1, depth + 1):
        z = model.fuse(batch.input_ids, parent)
        k, v = model.project_fused(z, positions)
        keys.append(k)
        values.append(v)
        blocks = [(pos[None, :] <= pos[:, None] - step) & (pos[None, :] >= 1)]
        blocks += [pos[None, :] == pos[:, None] - step + i for i in range(1, step + 1)]
        valid = (pos[None, :] < batch.lengths[:, None]).repeat(1, step + 1)
        mask = torch.cat(blocks, dim=1)[None, None] & valid[:, None, None, :]          # [B, 1, L, (step+1) L]
        hidden = model.attend(z, positions, torch.cat(keys, 2), torch.cat(values, 2), mask)  # [B, L, d]
        per_step.append(top1_tokens(model, hidden, vocab))
        parent = torch.cat([hidden.new_zeros(B, 1, d), hidden[:, :-1]], dim=1)   # row p's parent: row p-1
    out = {}
    for offset in range(depth):
        tokens = torch.full((B, L), -1, dtype=torch.long, device=pos.device)
        for step in range(1, depth + 1):
            rows = torch.arange((offset + step - 1) % depth, L, depth, device=pos.device)
            tokens[:, rows] = per_step[step - 1][:, rows]
        out[offset] = tokens
    return out
