"""Key/value caches for speculative decoding: pruning the target's cache, growing the drafter's.

The target verifies a whole draft tree in one pass, so its cache briefly holds every tree node; after
acceptance only the committed prefix plus the accepted path may stay. The drafter keeps its own cache of
projected TRUE target states (docs/method.md §5.1); drafted states never enter it.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by the target's cache (layer 0)."""
    return cache.get_seq_length()


def keep_cache_positions(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only the cache positions in `keep` (ascending LongTensor), in place, on every layer.

    Only plain `DynamicLayer`s can be pruned this way: transformers' sliding-window or quantized layers store
    positions in a form that an index along the sequence axis would corrupt, so we refuse them (`new_cache`
    builds full-length layers for sliding-window targets; beagle/decoding/attention_layout.py).
    """
    for index, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"cache layer {index} is a {type(layer).__name__}; speculative decoding supports only full "
                "length layers (DynamicLayer); build the cache with beagle.decoding.verify.new_cache")
        if not layer.is_initialized:
            continue
        index_on_device = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index_on_device)  # [B, H_kv, L_keep, hd]
        layer.values = layer.values.index_select(-2, index_on_device)


class DraftKeyCache:
    """The drafter's keys and values: projected true target states, one per committed position.

    Projection (norm + RoPE + k/v weights) is done once per state when it is appended, so a draft step
    only pays for its queries.
    """

    def __init__(self, drafter: torch.nn.Module) -> None:
        self._drafter = drafter
        self.keys: torch.Tensor | None = None    # [1, H_kv, L, hd]
        self.values: torch.Tensor | None = None  # [1, H_kv, L, hd]

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, states: torch.Tensor, positions: torch.Tensor) -> None:
        """Project and append true states `[L, n_layers * d]` (the key layers, concatenated; `[L, d]` for the
        last layer alone) at absolute `positions` `[L]`."""
        keys, values = self._drafter.project_true_keys(states[None], positions[None])  # [1, H_kv, L, hd] each
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)


class StateKeyCache(DraftKeyCache):
    """The engine-form drafter's cache (beagle/state_beagle.py) at decoding time: the projected keys of the
    committed positions' fused states (`DraftKeyCache`), and the last of those states, which the next root
    query starts its residual from."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        super().__init__(drafter)
        self.last_state: torch.Tensor | None = None  # [d]

    def append(self, states: torch.Tensor, positions: torch.Tensor) -> None:
        """True key-layer states [L, n_layers * d] at positions [L], as the target produced them."""
        super().append(states, positions)
        self.last_state = self._drafter.fuse_true_states(states[-1:])[0]
