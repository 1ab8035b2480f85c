"""A feature store seen through torch: samples and the frozen head as tensors, for training and eval.

`pipeline.store` is the bottom layer and never imports torch: it hands out numpy arrays typed as what they
hold (ml_dtypes.bfloat16 views of the stored bits, named by the store's `dtype`). This module is the one place
that turns them into tensors, so every reader in `beagle` gets the same views: zero-copy on a local store's memory map.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline.store import FeatureStore, StoreFormatError
from pipeline.store import open_store as open_feature_store
from pipeline.store.format import HEAD, NUMPY_DTYPES


# torch.from_numpy knows no ml_dtypes: such arrays go through their storage bits, then torch reinterprets them.
_TORCH_VIEWS = {NUMPY_DTYPES["bfloat16"]: (np.uint16, torch.bfloat16),
                NUMPY_DTYPES["float8_e4m3"]: (np.uint8, torch.float8_e4m3fn)}


def as_tensor(array: Any, logical: str | None = None) -> torch.Tensor:
    """A store array (ml_dtypes-typed, native float, or bf16 storage bits when `logical` says "bfloat16")
    as a tensor of its real dtype: bits reinterpreted, never converted; zero-copy for a memmap slice."""
    array = np.asarray(array)
    if array.dtype in _TORCH_VIEWS:
        bits, dtype = _TORCH_VIEWS[array.dtype]
        return torch.from_numpy(array.view(bits)).view(dtype)
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if logical == "bfloat16" and array.dtype == np.uint16 else tensor


def sample_tensors(store: FeatureStore, index: int) -> dict[str, Any]:
    """`sample_id`, `input_ids` [L] int64, `loss_mask` [L] bool, `hidden_states` [n_layers, L, d] in the
    store's dtype (float32 for float8_e4m3 stores, decoded)."""
    sample = store[index]
    return {
        "sample_id": sample["sample_id"],
        "input_ids": torch.from_numpy(sample["input_ids"]),
        "loss_mask": torch.from_numpy(sample["loss_mask"]),
        "hidden_states": as_tensor(sample["hidden_states"], store.dtype),
    }


def head_tensors(store: FeatureStore) -> dict[str, torch.Tensor]:
    """The frozen target weights: `embed_tokens` and `lm_head`, each [V, d]."""
    from safetensors.torch import load  # parses a JSON header and raw tensors: never executes code

    payload = store.head_bytes()
    try:
        return load(payload)
    except Exception as error:  # safetensors raises its own error types for a damaged header
        raise StoreFormatError(f"{store.url}/{HEAD} is not a valid safetensors file "
                               f"({type(error).__name__}: {error}); the store is damaged, rebuild it") from None


class TensorStore:
    """A FeatureStore whose `store[i]` and `load_head()` give torch tensors; everything else (manifest,
    lengths, get_numpy, get_tokens, ...) is the FeatureStore's own."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def __len__(self) -> int:
        return len(self.store)

    def __repr__(self) -> str:
        return f"TensorStore({self.store!r})"

    def __getitem__(self, index: int) -> dict[str, Any]:
        return sample_tensors(self.store, index)

    def load_head(self) -> dict[str, torch.Tensor]:
        return head_tensors(self.store)


def open_store(url: str, **options: Any) -> TensorStore:
    """`pipeline.store.open_store(url, **options)`, read as torch tensors."""
    return TensorStore(open_feature_store(url, **options))
