"""Measure the activation memory a forward pass keeps for backward, on any device.

On CPU there is no allocator peak to read, and the bytes autograd saves are what grows with the
number of stage-2 steps, so we count them: every tensor handed to autograd's saved-tensor hook,
deduplicated by storage, excluding the model's own parameters and buffers.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class SavedBytes:
    total: int = 0
    _seen: set[int] = field(default_factory=set)


@contextmanager
def count_saved_bytes(model: torch.nn.Module) -> Iterator[SavedBytes]:
    """Within the block, sum the bytes of distinct storages autograd saves for backward."""
    counter = SavedBytes()
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in own and ptr not in counter._seen:
            counter._seen.add(ptr)
            counter.total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter
