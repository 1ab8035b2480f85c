"""Torch tensors into a feature store: the producer's side of the store's numpy-only interface.

`pipeline.store` never imports torch. Extraction (and tests, tools) hold torch tensors, so this module
turns them into the storage form the store writes: bf16 as its uint16 bit pattern (bit-exact), fp8 and int8
as codes with per-token scales (rounded by torch), the head as the bytes of a safetensors file. `write_shard`,
`write_head` and `write_store` here take tensors (or numpy) and call the store's functions of the same role.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.store import StoreFormatError
from pipeline.store import format as fmt
from pipeline.store import writer
from pipeline.store.quantized import CODE_MAX


def encode_codes(states: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """states [..., L, d] (any float dtype) -> (codes [..., L, d], scales float32 [..., L]) of a lossy store
    `dtype`: float8_e4m3 (uint8 e4m3fn codes, rounded by torch) or int8 (round to nearest, -127..127).
    The scale maps each token's largest magnitude to the code's largest (pipeline/store/quantized.py)."""
    if dtype not in CODE_MAX:
        raise StoreFormatError(f"{dtype!r} is not a lossy store dtype; use one of {sorted(CODE_MAX)}")
    values = torch.as_tensor(states).detach().cpu().float()
    scales = values.abs().amax(dim=-1).clamp_min(1e-12) / CODE_MAX[dtype]  # [..., L]
    scaled = values / scales.unsqueeze(-1)
    if dtype == "int8":
        codes = scaled.round().clamp_(-CODE_MAX[dtype], CODE_MAX[dtype]).to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.numpy(), scales.numpy()


def fp8_encode(states: Any) -> tuple[np.ndarray, np.ndarray]:
    """states [..., L, d] (any float dtype) -> (codes uint8 [..., L, d], scales float32 [..., L])."""
    return encode_codes(states, "float8_e4m3")


def to_numpy(values: Any) -> np.ndarray:
    """A tensor (any device) or array-like as numpy; bf16 tensors become their uint16 bit pattern."""
    if isinstance(values, torch.Tensor):
        # Strided views stay views (numpy keeps the strides): the writer copies each layer's rows once,
        # into the file, and a padded batch's [n_layers, L, d] slice is not contiguous across layers.
        values = values.detach().cpu()
        return values.view(torch.uint16).numpy() if values.dtype == torch.bfloat16 else values.numpy()
    return np.asarray(values)


def _is_wide_float(states: Any) -> bool:
    """Whether `states` are float16/32/64 values (torch or numpy) that a bf16 store must round first."""
    if isinstance(states, torch.Tensor):
        return states.is_floating_point() and states.dtype != torch.bfloat16
    return isinstance(states, np.ndarray) and states.dtype in (np.float16, np.float32, np.float64)


def storage_sample(sample: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """One sample ({sample_id, input_ids [L], loss_mask [L], hidden_states [n_layers, L, d]}) in the
    storage form `pipeline.store.write_shard` takes for a `dtype` store."""
    states = sample["hidden_states"]
    converted = {"sample_id": sample["sample_id"], "input_ids": to_numpy(sample["input_ids"]),
                 "loss_mask": to_numpy(sample["loss_mask"])}
    if dtype in fmt.LOSSY_DTYPES:
        converted["hidden_states"], converted["hidden_scales"] = encode_codes(states, dtype)
        return converted
    if isinstance(states, torch.Tensor) and states.dtype == torch.bfloat16 and dtype != "bfloat16":
        raise StoreFormatError(f"got bfloat16 hidden states for a {dtype} store")
    if dtype == "bfloat16" and _is_wide_float(states):
        # A float32 target's states for a bf16 store (extract --dtype float32 --store-dtype bfloat16):
        # rounded to nearest even once, here, as torch rounds a bf16 forward's outputs. States already in
        # bf16 (a torch bf16 tensor, an ml_dtypes bfloat16 array or its uint16 bit pattern) pass unchanged.
        states = torch.as_tensor(states).to(torch.bfloat16)
    converted["hidden_states"] = to_numpy(states)
    return converted


def head_payload(*, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> bytes:
    """The bytes of `head.safetensors` for the target's embedding and LM head ([V, d] each)."""
    from safetensors.torch import save

    if tuple(embed_tokens.shape) != tuple(lm_head.shape):
        raise StoreFormatError(f"embed_tokens {tuple(embed_tokens.shape)} and lm_head {tuple(lm_head.shape)} "
                               "must both be [vocab, hidden]")
    # clone(): tied models (SmolLM2, Qwen2.5, Llama-3.2) share one matrix, which safetensors refuses.
    return save({"embed_tokens": embed_tokens.detach().cpu().clone().contiguous(),
                 "lm_head": lm_head.detach().cpu().clone().contiguous()})


def write_shard(url: str, shard_index: int, samples: list[Mapping[str, Any]], *, layers: list[int],
                dtype: str, compression: str | None = None, hidden_size: int | None = None,
                rejects: Sequence[Mapping[str, Any]] = ()) -> dict:
    """`pipeline.store.write_shard` for samples holding tensors (`hidden_size` and `rejects` as there);
    returns the shard's info."""
    return writer.write_shard(url, shard_index, [storage_sample(s, dtype) for s in samples], layers=layers,
                              dtype=dtype, compression=compression, hidden_size=hidden_size, rejects=rejects)


def write_head(url: str, *, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
    """Store the frozen target weights the drafter reuses ([V, d] each), so training never loads the target."""
    writer.write_head_bytes(url, head_payload(embed_tokens=embed_tokens, lm_head=lm_head))


def write_store(url: str, samples: Iterable[Mapping[str, Any]], *, head: Mapping[str, torch.Tensor],
                capture: dict, **options: Any) -> dict:
    """`pipeline.store.write_store` for samples and a head ({embed_tokens, lm_head}) holding tensors."""
    return writer.write_store(url, (storage_sample(s, capture["dtype"]) for s in samples),
                              head=head_payload(embed_tokens=head["embed_tokens"], lm_head=head["lm_head"]),
                              capture=capture, **options)
