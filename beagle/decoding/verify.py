"""The target's side: prefill, one-token steps, and verifying a whole draft tree in one forward pass.

A tree is verified by handing the target an explicit 4D attention mask. In transformers 5 a 4D mask is
passed to the attention kernel unchanged (`masking_utils._preprocess_mask_arguments` returns it as-is);
the eager kernel ADDS it to the scores while SDPA also accepts booleans, so we build the float additive
form (0 = visible, dtype minimum = hidden), which both read the same way. Any causal LM whose decoder
takes a 4D mask (or, when it mixes layer types, a dict of them), explicit `position_ids` and a `DynamicCache`
(whose layers we replace by preallocated ones, beagle/decoding/kv_cache.py) works: Llama, Mistral,
Qwen2/Qwen3, Gemma 2/3, SmolLM2 among them. Sliding-window layers get their own mask and a cache that can be
cut back (beagle/decoding/attention_layout.py).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from beagle.decoding.attention_layout import attention_layout
from beagle.decoding.gqa_attention import masked_gqa
from beagle.decoding.tree import DraftTree
from beagle.layer_capture import LayerCapture


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [L, V] next-token logits after each input token ([1, V]: the last only)
    hidden: torch.Tensor  # [L, n_layers * d] states of the drafter's key layers, concatenated ([L, d] for -1 alone)


@functools.lru_cache(maxsize=None)
def _forward_parameters(model_class: type) -> frozenset[str]:
    """The argument names of a model class's forward, read once per class (every decoding step asks)."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def _cache_keyword(model: torch.nn.Module) -> str:
    """transformers >= 5.x names the cache argument `cache`; earlier versions `past_key_values`."""
    return "cache" if "cache" in _forward_parameters(type(model)) else "past_key_values"


def new_cache(model: torch.nn.Module, capacity: int = 0) -> DynamicCache:
    """A preallocated cache with room for `capacity` positions (it grows past them if it must), every layer of
    which can be rolled back by position (full length, sliding layers included; beagle/decoding/kv_cache.py)."""
    return attention_layout(model).new_cache(model, capacity)


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, before any decoding, a target whose cache cannot be pruned by position (ValueError)."""
    attention_layout(model)


def run_target(model: torch.nn.Module, cache: DynamicCache, input_ids: torch.Tensor,
               position_ids: torch.Tensor | None = None,
               attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
               hidden: bool = True, layers: tuple[int, ...] = (-1,), last_logits_only: bool = False) -> TargetOutput:
    """One target forward over `input_ids` `[L]` that appends to `cache`; returns logits and the states of
    `layers` (HF hidden_states indices, -1 = after the final norm), concatenated in that order.

    `last_logits_only` (a prefill, a plain step): only the last position's logits are computed (`[1, V]`), not
    `[L, V]`: for a long prompt and a large vocabulary that is most of the LM head's time and memory."""
    keep = {"logits_to_keep": 1} if last_logits_only and "logits_to_keep" in _forward_parameters(type(model)) else {}
    capture = LayerCapture(model, layers) if hidden else None  # hooks keep only `layers`, not all n+1
    with capture or contextlib.nullcontext():
        outputs = model(input_ids=input_ids[None],
                        position_ids=None if position_ids is None else position_ids[None],
                        attention_mask=attention_mask, use_cache=True,
                        output_hidden_states=capture is not None and capture.output_hidden_states,
                        **{_cache_keyword(model): cache}, **keep)
    states = torch.cat([state[0] for state in capture.states(outputs)], dim=-1) if capture else None
    return TargetOutput(logits=outputs.logits[0], hidden=states)


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """`[N, N]` bool: row i marks node i and its ancestors, from `parents` `[N]` (-1 for the root).

    Computed on the parents' device without reading them back: the one-step relation (self or parent) is
    squared ceil(log2 N) times, each squaring doubling the path length it covers, so no host loop over the
    nodes and no synchronisation per round."""
    size = parents.shape[0]
    has_parent = (parents >= 0)[:, None]  # [N, 1]
    columns = torch.arange(size, device=parents.device)
    step = (parents.clamp(min=0)[:, None] == columns[None, :]) & has_parent  # [N, N] i -> parent(i)
    reach = (step | torch.eye(size, dtype=torch.bool, device=parents.device)).float()
    for _ in range(max(1, math.ceil(math.log2(size)))):
        reach = (reach @ reach).clamp_(max=1.0)  # paths of up to twice the length
    return reach.bool()


def tree_attention_mask(parents: torch.Tensor, depths: torch.Tensor, past_length: int, dtype: torch.dtype,
                        device: torch.device, model: torch.nn.Module) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive mask `[1, 1, N+1, past+N+1]` (a dict of them by layer type for a hybrid target): every node sees
    the committed past, itself and its ancestors; sliding-window layers only those within their window."""
    ancestors = tree_ancestors(parents.to(device))  # [N+1, N+1]
    visible = torch.cat([torch.ones(ancestors.shape[0], past_length, dtype=torch.bool, device=device), ancestors],
                        dim=-1)
    query_positions = past_length + depths.to(device)  # [N+1]
    key_positions = torch.cat([torch.arange(past_length, device=device), query_positions])  # [past+N+1]
    return attention_layout(model).tree_masks(visible, query_positions, key_positions, dtype)


def verify_tree(model: torch.nn.Module, cache: DynamicCache, tree: DraftTree, past_length: int,
                layers: tuple[int, ...] = (-1,)) -> TargetOutput:
    """Run the target once over every tree position; the cache then holds past + all N+1 positions."""
    dtype = next(model.parameters()).dtype
    mask = tree_attention_mask(tree.parents, tree.depths, past_length, dtype, tree.tokens.device, model)
    positions = past_length + tree.depths  # [N+1]
    with masked_gqa(model):  # on a CPU, no per-pass copy of the cache for grouped heads (gqa_attention.py)
        return run_target(model, cache, tree.tokens, positions, mask, layers=layers)
