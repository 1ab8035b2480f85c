"""Verification attention without copying the cache per head group, on CPUs.

With an explicit mask and more than one query, transformers' SDPA path repeats every key/value head for its
group of query heads (`repeat_kv`) before calling the kernel: a copy of the whole cache, times the group
size, in every layer of every verification pass (the profile of a demo round: a fifth of the pass). On
CUDA that copy buys the fused kernels, which refuse a mask with `enable_gqa`; torch's CPU flash kernel takes
both, with the same result bit for bit. So on a CPU a verification pass runs with `enable_gqa`, and
everywhere else transformers' own path is used unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "beagle_masked_gqa_sdpa"


def _masked_gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query `[B, H, Q, hd]`, key/value `[B, H_kv, K, hd]`, an additive or boolean mask `[B, 1, Q, K]`
    -> `[B, Q, H, hd]`, as transformers' attention functions return it."""
    plain = (query.device.type != "cpu" or attention_mask is None or query.shape[2] == 1
             or getattr(module, "num_key_value_groups", 1) == 1 or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                      **kwargs)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, enable_gqa=True)  # [B, H, Q, hd]
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, _masked_gqa_sdpa)


@contextlib.contextmanager
def masked_gqa(model: torch.nn.Module) -> Iterator[None]:
    """Inside: a CPU target that attends with SDPA and groups its key/value heads attends with `enable_gqa`
    (one forward at a time: the model's config names the attention function while it runs)."""
    config = model.config
    switch = (getattr(config, "_attn_implementation", None) == "sdpa"
              and next(model.parameters()).device.type == "cpu"
              and getattr(config, "num_key_value_heads", None) not in (None, getattr(config, "num_attention_heads", None)))
    if not switch:
        yield
        return
    config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"
