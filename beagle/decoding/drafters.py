"""What the tree builder needs from a drafter, one backend per drafter form of beagle/registry.py: Beagle, its
engine form and the EAGLE-2 baseline (docs/method.md §7, §9).

All keep a cache of keys for the committed (true) positions and, while drafting, a bank of keys for drafted
nodes that only the node's descendants see. They differ in what a key is and how a query is formed:

* Beagle: keys are projected target states; a query is the token's embedding alone. A drafted state ĥ
  becomes a key for descendants only with concatenation (`--no-concat` turns it off).
* EAGLE-2: keys are fused fc([Emb(t_p), h_{p-1}]); a query fuses its token with its parent's state (true
  h_n for the root, the parent's drafted state deeper) and also sees its own fused key, which is what its
  descendants see. Feeding drafted states back is inherent to it.
* Beagle, engine form: keys are projected fused states; a query's residual starts from its parent's state and
  its output is the key its descendants see, as an EAGLE-3 engine drafts.
"""
from __future__ import annotations

import torch

from beagle.decoding.kv_cache import DraftKeyCache, StateKeyCache


def _scored_logits(drafter: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`[B, q, N]` logits over the drafter's draft vocabulary (`[B, q, V]` without one): drafting ranks and
    normalises over N columns, never over a V-wide row of -inf (at a 262k vocabulary that was most of a round)."""
    return drafter.logits(hidden) if drafter.draft_columns is None else drafter.compact_logits(hidden)


class _CachedBackend:
    """What every backend shares: the drafter, its cache of keys for the committed positions, the scored
    columns, and the logits over them."""

    concatenate = True

    def __init__(self, drafter: torch.nn.Module, cache) -> None:
        self.drafter = drafter
        self.cache = cache
        self.token_ids = drafter.draft_columns  # [N] or None: the token id of each logit column

    def append(self, states: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """True states `[L, n_layers * d]` of the tokens `[L]` at `positions` `[L]`, as the target produced them."""
        self.cache.append(states, positions)

    def keys(self) -> torch.Tensor:
        return self.cache.keys

    def values(self) -> torch.Tensor:
        return self.cache.values

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, q, N]` over the columns `token_ids` names (all V when it is None)."""
        return _scored_logits(self.drafter, hidden)


class BeagleBackend(_CachedBackend):
    def __init__(self, drafter: torch.nn.Module, concatenate: bool) -> None:
        super().__init__(drafter, DraftKeyCache(drafter))
        self.concatenate = concatenate

    def root_parent_states(self) -> torch.Tensor | None:
        return None

    def step(self, tokens, positions, parent_states, keys, values, mask, need_bank: bool):
        """Draft states `[1, q, d]` of the queries, and their keys for descendants (or None)."""
        hidden = self.drafter.forward_hidden(tokens, positions, keys, values, mask)  # [1, q, d]
        bank = self.drafter.project_keys(hidden, positions) if need_bank and self.concatenate else None
        return hidden, bank


class Eagle2Backend(_CachedBackend):
    def __init__(self, drafter: torch.nn.Module, concatenate: bool = True) -> None:
        from beagle.eagle2 import Eagle2KeyCache

        super().__init__(drafter, Eagle2KeyCache(drafter))

    def append(self, states: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        self.cache.append(states, positions, tokens)

    def _empty(self) -> torch.Tensor:
        """No key yet (a one-token prompt: position 0 has no previous state)."""
        config, state = self.drafter.config, self.cache.last_state
        return state.new_zeros(1, config.num_key_value_heads, 0, config.head_dim)

    def keys(self) -> torch.Tensor:
        return self._empty() if self.cache.keys is None else self.cache.keys

    def values(self) -> torch.Tensor:
        return self._empty() if self.cache.values is None else self.cache.values

    def root_parent_states(self) -> torch.Tensor:
        return self.cache.last_state[None, None]  # [1, 1, d]: h_n, fused with the root token

    def step(self, tokens, positions, parent_states, keys, values, mask, need_bank: bool):
        hidden, own_keys, own_values = self.drafter.draft_step(tokens, positions, parent_states.to(keys.dtype),
                                                               keys, values, mask)
        return hidden, (own_keys.to(keys.dtype), own_values.to(values.dtype))


class StateBeagleBackend(_CachedBackend):
    """The engine-form Beagle (docs/method.md §9): keys are projected fused states; a query's residual starts
    from its parent's state (the last true state for the root, the parent's output deeper), and every drafted
    output is a key for the node's descendants, as an EAGLE-3 engine drafts it (so always concatenated)."""

    def __init__(self, drafter: torch.nn.Module, concatenate: bool = True) -> None:
        super().__init__(drafter, StateKeyCache(drafter))

    def root_parent_states(self) -> torch.Tensor:
        return self.cache.last_state[None, None]  # [1, 1, d]: s_n, the root query's residual

    def step(self, tokens, positions, parent_states, keys, values, mask, need_bank: bool):
        hidden = self.drafter.forward_hidden(tokens, positions, keys, values, mask, parent_states)  # [1, q, d]
        bank = self.drafter.project_keys(hidden, positions) if need_bank else None
        return hidden, bank


def draft_backend(drafter: torch.nn.Module, concatenate: bool = True):
    """The backend of a drafter's form (beagle/registry.py), by its `drafter_type`; `concatenate=False` is
    refused for a form that always feeds drafted states back."""
    from beagle.registry import form_of

    return form_of(drafter).decoding_backend(drafter, concatenate)
