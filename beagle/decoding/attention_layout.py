"""How the target's layers attend, as verification must honour it: one mask per layer type, and a cache
that can be cut back after a rejection.

A draft tree is verified with an explicit mask (docs/method.md §5.1). Full-attention layers let a node see
the whole committed past plus its ancestors. Sliding-window layers (Mistral, Gemma 2/3, Qwen2 with
`use_sliding_window`, Phi-3) must in addition hide every key W or more positions behind the query, exactly as
the model's own mask does in plain decoding (`kv_idx > q_idx - W`). Each layer type gets its own mask;
a model that mixes types receives them as a `{layer type: mask}` dict, which transformers' hybrid decoders
take as is.

transformers' own cache keeps only the last W positions of a sliding layer and rolls them over, so an index
along its sequence axis no longer names a position and a rejected draft cannot be cut out of it. We give
sliding layers a full-length layer instead (the same preallocated layer as full attention, kv_cache.py): every position stays addressable (the cache of a sliding
layer grows like a full one's, the memory price of exact rollback), and the window is applied by the mask.
Layer kinds whose state is not one key/value per position (linear attention, convolutions, chunked or
compressed attention) cannot be rolled back that way and are refused before any decoding.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from beagle.decoding.kv_cache import new_static_cache
from beagle.target_facts import FULL_ATTENTION, SLIDING_ATTENTION, facts_from_config

ROLLBACK_SAFE = (FULL_ATTENTION, SLIDING_ATTENTION)
_LAYOUTS: "weakref.WeakKeyDictionary[torch.nn.Module, AttentionLayout]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AttentionLayout:
    """The target's layer types (one per layer) and the window of its sliding layers."""

    layer_types: tuple[str, ...]
    sliding_window: int | None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The distinct layer types, in first-seen order."""
        return tuple(dict.fromkeys(self.layer_types))

    def new_cache(self, model: torch.nn.Module, capacity: int = 0) -> DynamicCache:
        """A cache of full-length preallocated layers, one per layer, with room for `capacity` positions, that
        beagle/decoding/kv_cache.py rolls back by position."""
        return new_static_cache(model, capacity)

    def tree_masks(self, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive masks `[1, 1, Q, K]` from the full-attention visibility `visible` `[Q, K]` (bool).

        `query_positions` `[Q]` and `key_positions` `[K]` are absolute positions; a sliding layer also hides
        keys with query - key >= window. One tensor when every layer is of one type, else a dict by type.
        """
        masks = {}
        for kind in self.kinds:
            seen = visible
            if kind == SLIDING_ATTENTION:
                distance = query_positions[:, None] - key_positions[None, :]  # [Q, K]
                seen = visible & (distance < self.sliding_window)
            mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
            masks[kind] = mask.masked_fill_(~seen, torch.finfo(dtype).min)[None, None]
        return masks[self.kinds[0]] if len(masks) == 1 else masks


def attention_layout(model: torch.nn.Module) -> AttentionLayout:
    """The layout of `model` (read once per model: every verification asks); ValueError naming the model and
    the layer kind when drafts could not be rolled back out of its cache."""
    if model not in _LAYOUTS:
        _LAYOUTS[model] = _read_layout(model)
    return _LAYOUTS[model]


def _read_layout(model: torch.nn.Module) -> AttentionLayout:
    facts = facts_from_config(model.config, where=type(model).__name__)
    odd = sorted(set(facts.layer_types) - set(ROLLBACK_SAFE))
    if odd:
        raise ValueError(f"{type(model).__name__} has {', '.join(odd)} layers, whose cache holds a running state "
                         "rather than one key/value per position, so rejected drafts cannot be removed from it; "
                         "speculative decoding here supports full-attention and sliding-window layers")
    if SLIDING_ATTENTION in facts.layer_types and not facts.sliding_window:
        raise ValueError(f"{type(model).__name__} has sliding-attention layers but its config gives no "
                         "sliding_window; set it in config.json")
    return AttentionLayout(facts.layer_types, facts.sliding_window)
