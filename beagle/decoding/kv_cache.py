"""Key/value caches for speculative decoding, preallocated and rolled back by position (as gpt-fast and EAGLE do).

The target verifies a whole draft tree in one pass, so its cache briefly holds every tree node after the
committed prefix; after acceptance only the prefix, the root and the accepted path may stay. Both caches here
are one buffer per layer, allocated once for the whole answer and written in place: rejecting a draft moves
the length back (the rejected positions are overwritten by the next pass), and keeping a tree's accepted path
copies its few rows into place, so no round copies a whole cache (before: `torch.cat` on every forward and an
`index_select` of every layer per round). The drafter keeps its own cache of projected TRUE target states
(docs/method.md §5.1); drafted states only borrow the space past its length for the round they are drafted in.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_GROWTH = 2  # a buffer outgrown (an answer longer than planned) is reallocated at twice the size: rare, amortised


class KeyValueBuffer:
    """Keys and values `[B, H_kv, capacity, hd]` allocated once; `keys`/`values` are views of the first `length`.

    Positions at and past `length` are scratch: `write` puts rows there (a verification pass, a draft step's
    keys) without committing them, `commit` moves the length, and `move` copies rows into place."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.length = 0
        self._keys: torch.Tensor | None = None    # [B, H_kv, capacity, hd]
        self._values: torch.Tensor | None = None  # [B, H_kv, capacity, hd]

    @property
    def allocated(self) -> bool:
        return self._keys is not None

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` positions before any write (one allocation for the whole answer)."""
        self.capacity = max(self.capacity, capacity)
        if self._keys is not None and self._keys.shape[-2] < capacity:
            self._grow(capacity)

    def _grow(self, needed: int) -> None:
        """Reallocate to hold `needed` rows, keeping every row written so far: the committed ones and the scratch
        rows past `length` too (a draft tree's keys live there while later steps write more and attend to them)."""
        old = self._keys.shape[-2]
        size = max(needed, _GROWTH * old)
        keys = self._keys.new_empty(*self._keys.shape[:-2], size, self._keys.shape[-1])
        values = self._values.new_empty(*self._values.shape[:-2], size, self._values.shape[-1])
        keys[..., :old, :] = self._keys
        values[..., :old, :] = self._values
        self._keys, self._values = keys, values

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Write `[B, H_kv, L, hd]` rows at positions start..start+L-1 (allocating on first use); the end."""
        end = start + keys.shape[-2]
        if self._keys is None:
            capacity = max(self.capacity, end)
            self._keys = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
            self._values = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
        elif end > self._keys.shape[-2]:
            self._grow(end)
        self._keys[..., start:end, :] = keys
        self._values[..., start:end, :] = values
        return end

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write at the length and commit."""
        self.length = self.write(self.length, keys, values)

    def move(self, sources: list[int], start: int) -> None:
        """Copy rows `sources` (ascending, each >= its destination) to start, start+1, ... (a tree's accepted
        path into the places after the root): len(sources) rows per layer, not the cache."""
        if sources == list(range(start, start + len(sources))):
            return  # a chain's accepted prefix is already in place
        index = torch.tensor(sources, device=self._keys.device)
        self._keys[..., start:start + len(sources), :] = self._keys.index_select(-2, index)
        self._values[..., start:start + len(sources), :] = self._values.index_select(-2, index)

    def view(self, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, H_kv, length + extra, hd]` (views; `extra` reaches into the scratch rows)."""
        end = self.length + extra
        return self._keys[..., :end, :], self._values[..., :end, :]


class PreallocatedLayer(DynamicLayer):
    """A transformers cache layer over a `KeyValueBuffer`: the model sees a full-length layer (every position
    addressable, as `DynamicLayer`, also for sliding-window layers: beagle/decoding/attention_layout.py), whose
    `update` writes in place and returns views of the first `length` positions."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.buffer = KeyValueBuffer(capacity)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.buffer.append(key_states, value_states)
        self.keys, self.values = self.buffer.view()
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions: the rest become scratch, overwritten by the next pass."""
        self.buffer.length = length
        if self.buffer.allocated:
            self.keys, self.values = self.buffer.view()

    def get_seq_length(self) -> int:
        return self.buffer.length

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count of positions to drop (or the length to keep)."""
        self.truncate(self.buffer.length + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove)

    def reset(self) -> None:
        self.truncate(0)


def new_static_cache(model: torch.nn.Module, capacity: int = 0) -> DynamicCache:
    """A cache of `PreallocatedLayer`s for `model`, each with room for `capacity` positions."""
    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


def _layers(cache: DynamicCache) -> list[PreallocatedLayer]:
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, PreallocatedLayer):
            raise ValueError(f"cache layer {index} is a {type(layer).__name__}; speculative decoding rolls back only "
                             "preallocated full-length layers; build the cache with beagle.decoding.verify.new_cache")
    return cache.layers


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by the target's cache (layer 0)."""
    return cache.get_seq_length()


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Roll every layer back to its first `length` positions (no copy)."""
    for layer in _layers(cache):
        layer.truncate(length)


def commit_path(cache: DynamicCache, past: int, path: list[int]) -> None:
    """After verifying a tree at positions past..past+N: keep the prefix, the root (at `past`) and the accepted
    tree positions `path` (ascending), moved to past+1..past+len(path). A chain's path is already in place."""
    for layer in _layers(cache):
        if layer.buffer.allocated:
            layer.buffer.move([past + node for node in path], past + 1)
        layer.truncate(past + 1 + len(path))


class DraftKeyCache:
    """The drafter's keys and values: projected true target states, one per committed position.

    Projection (norm + RoPE + k/v weights) is done once per state when it is appended, so a draft step
    only pays for its queries. The buffer past the committed length holds the round's drafted keys
    (`beagle/decoding/tree.py`), so a draft step attends over one view instead of a concatenation."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        self._drafter = drafter
        self.buffer = KeyValueBuffer()

    def __len__(self) -> int:
        return self.buffer.length

    @property
    def keys(self) -> torch.Tensor | None:
        """`[1, H_kv, L, hd]` (a view), None before the first append."""
        return self.buffer.view()[0] if self.buffer.allocated else None

    @property
    def values(self) -> torch.Tensor | None:
        return self.buffer.view()[1] if self.buffer.allocated else None

    def reserve(self, capacity: int) -> None:
        self.buffer.reserve(capacity)

    def append(self, states: torch.Tensor, positions: torch.Tensor) -> None:
        """Project and append true states `[L, n_layers * d]` (the key layers, concatenated; `[L, d]` for the
        last layer alone) at absolute `positions` `[L]`."""
        keys, values = self._drafter.project_true_keys(states[None], positions[None])  # [1, H_kv, L, hd] each
        self.buffer.append(keys, values)


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
