"""Training data from feature stores: memory-mapped reads, token-budget batches, one-batch prefetch.

The batch plan of an epoch depends only on (seed, epoch), so a resumed run can skip to the batch it
stopped at without replaying anything. No Ray, no target model: just `pipeline.store.open_store`, read
as tensors through `beagle.torch_store`.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from beagle.torch_store import open_store

log = logging.getLogger(__name__)


@dataclass
class Batch:
    input_ids: Tensor      # [B, L] int64, padded with 0
    loss_mask: Tensor      # [B, L] bool, False on padding
    hidden: Tensor         # [B, L, d] target states (the layer the LM head reads): float32 once on the device
    lengths: Tensor        # [B] int64 true lengths
    row_start: int = 0                # data parallel: first row of this micro-batch in the global batch
    global_rows: int | None = None    # rows of the global batch (None: this batch is the global batch)
    key_states: Tensor | None = None  # [B, L, n_layers * d]: the key layers, for fused keys (as `hidden`)
    token_count: int | None = None    # sum of lengths, known on the host when the batch is built

    def to(self, device: torch.device) -> "Batch":
        """The batch on `device`, states in float32. States read in the store's dtype (bf16 on a GPU run)
        cross in that dtype, half the bytes of fp32, and are cast on the device."""
        def states(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=True).float()
        key_states = None if self.key_states is None else states(self.key_states)
        return Batch(self.input_ids.to(device, non_blocking=True), self.loss_mask.to(device, non_blocking=True),
                     states(self.hidden), self.lengths.to(device, non_blocking=True),
                     self.row_start, self.global_rows, key_states, self.tokens)

    def key_input(self, key_states: bool) -> Tensor:
        """What a drafter's true keys are made of: the key layers' states (`DrafterConfig.reads_key_states`),
        else `hidden`."""
        if not key_states:
            return self.hidden
        if self.key_states is None:
            raise ValueError("the drafter reads other target layers than the last but this batch carries the "
                             "last layer only; read the stores with StoreSet(..., key_layers=...)")
        return self.key_states

    def noise(self, generator: torch.Generator | None, draw: Any = torch.randn) -> Tensor:
        """[B, L, d] noise for this micro-batch's rows.

        Drawn row by row over the whole global batch, in order, keeping this micro-batch's rows: every rank
        advances the generator alike and each row gets the noise a one-process run gives it. Rows of other
        ranks are drawn into one scratch row, so a rank holds its own rows plus one, not the global batch
        (W times its micro-batch under W-way data parallelism)."""
        B, L, d = self.hidden.shape
        rows = B if self.global_rows is None else self.global_rows
        options = {"device": self.hidden.device, "dtype": self.hidden.dtype}
        kept = torch.empty(B, L, d, **options)                                   # [B, L, d]
        scratch = torch.empty(L, d, **options) if rows > B else None            # [L, d], other ranks' rows
        for row in range(rows):
            mine = self.row_start <= row < self.row_start + B
            draw((L, d), generator=generator, out=kept[row - self.row_start] if mine else scratch, **options)
        return kept

    @property
    def tokens(self) -> int:
        """Real tokens in the batch; from the host's count when there is one (reading `lengths` on a
        device would wait for it)."""
        return self.token_count if self.token_count is not None else int(self.lengths.sum())


def fingerprint(target: dict) -> dict[str, Any]:
    """What identifies a target model: its name and the hashes of its config and weights."""
    return {k: target.get(k) for k in ("name", "config_sha256", "weights_sha256")}


def _describe(store_url: str, target: dict) -> str:
    fp = fingerprint(target)
    return f"{store_url} (target {fp['name']}, weights {str(fp['weights_sha256'])[:12]})"


class StoreSet:
    """One or more stores of the same target, read as one list of samples."""

    def __init__(self, urls: list[str], *, cache_dir: str | None = None, verify: bool = True,
                 fuse_layers: bool = False, key_layers: tuple[int, ...] | None = None, aux_keys: bool = False,
                 verify_share: tuple[int, int] = (0, 1)) -> None:
        """verify: hash each store file on its first read (a corrupted or foreign file stops training,
        named, before any of its bytes reach a batch); see docs/reliability.md.
        fuse_layers: samples also carry every captured layer's states (`key_layers` order), concatenated,
        for a drafter with fused keys; `key_layers` names those layers instead (a trained drafter's).
        verify_share: (rank, world) under data parallelism: each rank hashes its share of the shards, so
        the job reads every shard's bytes for verification once, not once per rank."""
        if not urls:
            raise ValueError("no --store given; pass at least one feature store written by `extract`")
        self.urls = [str(u) for u in urls]
        self.stores = [open_store(u, cache_dir=cache_dir, verify="first-read" if verify else "none",
                                  verify_share=verify_share) for u in self.urls]
        first = self.stores[0]
        for url, store in zip(self.urls[1:], self.stores[1:]):
            if fingerprint(store.target) != fingerprint(first.target):
                raise ValueError(f"stores come from different targets: {_describe(self.urls[0], first.target)} "
                                 f"vs {_describe(url, store.target)}; train on stores of one target only")
            if store.hidden_size != first.hidden_size:
                raise ValueError(f"hidden_size differs: {self.urls[0]} has {first.hidden_size}, "
                                 f"{url} has {store.hidden_size}")
        self._layer = [self._pick_layer(u, s.layers) for u, s in zip(self.urls, self.stores)]
        if key_layers:
            self.key_layers = tuple(key_layers)
        elif aux_keys:
            self.key_layers = self._aux_layers()
        else:
            self.key_layers = self._fusable_layers() if fuse_layers else (-1,)
        for url, store in zip(self.urls, self.stores):
            missing = sorted(set(self.key_layers) - set(store.layers))
            if missing:
                layers = ",".join(map(str, self.key_layers))
                raise ValueError(f"{url} did not capture layer(s) {missing} (it has {store.layers}); the drafter "
                                 f"needs {list(self.key_layers)}: re-extract with --layers {layers}")
        self._key_index = [[list(s.layers).index(layer) for layer in self.key_layers] for s in self.stores]
        sizes = [len(s) for s in self.stores]
        self._starts = np.cumsum([0] + sizes)
        self.lengths = np.concatenate([s.lengths for s in self.stores]) if sizes else np.zeros(0, np.int64)
        if len(self.lengths) == 0:
            raise ValueError(f"the stores {self.urls} hold no samples")

    @staticmethod
    def _pick_layer(url: str, layers: list[int]) -> int:
        """Index of the state the LM head reads (layer -1); stores captured without it cannot train."""
        if -1 in layers:
            return layers.index(-1)
        raise ValueError(f"{url} captured layers {layers} but not -1 (the state the LM head reads); "
                         "re-extract with the default capture")

    def _common_layers(self) -> set[int]:
        """The layers every store captured."""
        return set.intersection(*[set(s.layers) for s in self.stores])

    def _fusable_layers(self) -> tuple[int, ...]:
        """The layers every store captured, in depth order with -1 (after the final norm) last."""
        captured = [set(s.layers) for s in self.stores]
        common = self._common_layers()
        if any(c != common for c in captured):
            raise ValueError(f"the stores captured different layers ({[sorted(c) for c in captured]}); fused keys "
                             "need the same layers in every store")
        if len(common) < 2:
            raise ValueError(f"{self.urls[0]} captured only layer(s) {sorted(common)}; fused keys need several: "
                             "re-extract with e.g. `--layers 8,16,-1`, or train without --fuse-layers")
        return tuple(sorted(common - {-1})) + (-1,)

    def _aux_layers(self) -> tuple[int, ...]:
        """The residual-stream layers (0..n-1, not -1) every store captured, ascending: the keys of a
        state-residual drafter (docs/method.md §9), the layers an engine hands an EAGLE-3 drafter."""
        common = self._common_layers() - {-1}
        if not common:
            raise ValueError(f"{self.urls[0]} captured only layer(s) {sorted(self.stores[0].layers)}; a state-residual "
                             "drafter reads the residual stream entering decoder layers: re-extract with e.g. "
                             "`--layers 2,15,27,-1` (or `--layers N-1,-1` for the last layer's input)")
        return tuple(sorted(common))

    @property
    def target(self) -> dict:
        return self.stores[0].target

    @property
    def hidden_size(self) -> int:
        return self.stores[0].hidden_size

    @property
    def dataset_ids(self) -> list[str]:
        return [s.dataset_id for s in self.stores]

    def load_head(self) -> dict[str, Tensor]:
        return self.stores[0].load_head()

    @property
    def recorded_urls(self) -> list[str]:
        """The stores' URLs as a run records them: a local path made absolute (a run's record of a relative
        path would name whatever a later command's current folder holds), a fsspec URL as given."""
        return [url if "://" in url else str(Path(url).resolve()) for url in self.urls]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def sample(self, index: int, limit: int, *, as_stored: bool = False) -> tuple[Tensor, ...]:
        """(input_ids [L], loss_mask [L], hidden [L, d] float32), truncated to `limit` tokens; with fused
        key layers also key_states [L, n_layers * d] float32. `as_stored`: states in the store's dtype
        (bf16 stays bf16), for a GPU run that casts them on the device."""
        which = int(np.searchsorted(self._starts, index, side="right") - 1)
        s = self.stores[which][int(index - self._starts[which])]
        dtype = None if as_stored else torch.float32
        hidden = s["hidden_states"][self._layer[which], :limit]
        fields = (s["input_ids"][:limit], s["loss_mask"][:limit], hidden.to(dtype or hidden.dtype))
        if self.key_layers == (-1,):
            return fields
        layers = s["hidden_states"][self._key_index[which], :limit]                 # [n, L, d]
        return (*fields, layers.transpose(0, 1).reshape(layers.shape[1], -1).to(dtype or layers.dtype))

    def per_store(self, indices: list[int]) -> list[set[int]]:
        """Sample indices of the set as each store's own indices: [{local index, ...} per store]."""
        out: list[set[int]] = [set() for _ in self.stores]
        for index in indices:
            which = int(np.searchsorted(self._starts, index, side="right") - 1)
            out[which].add(int(index - self._starts[which]))
        return out

    def state_rms(self, max_samples: int, limit: int, indices: np.ndarray | None = None) -> float:
        """RMS of the target states over the first samples (of `indices`, when given: the training samples
        of a run that holds some out): the scale the key noise is relative to."""
        total, count = 0.0, 0
        chosen = range(len(self)) if indices is None else [int(i) for i in indices]
        for i in chosen[:max_samples]:
            h = self.sample(i, limit)[2].double()
            total += float(h.square().sum())
            count += h.numel()
        return (total / max(count, 1)) ** 0.5


def plan_epoch(lengths: np.ndarray, *, batch_tokens: int, limit: int, seed: int, epoch: int,
               min_rows: int = 1) -> list[list[int]]:
    """Token-budget batches for one epoch: shuffle, sort by length inside groups of 256 samples to
    cut padding, pack while B * max_len <= batch_tokens, then shuffle the batches.

    min_rows: every batch gets at least this many samples (the data-parallel world size, so that no rank
    is handed an empty slice), even where that exceeds the budget; a short tail joins the batch before it."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    clipped = np.minimum(lengths, limit)
    batches: list[list[int]] = []
    for g in range(0, len(order), 256):
        group = sorted(order[g:g + 256].tolist(), key=lambda i: -int(clipped[i]))
        current: list[int] = []
        longest = 0
        for i in group:
            new_longest = max(longest, int(clipped[i]))
            if len(current) >= min_rows and (len(current) + 1) * new_longest > batch_tokens:
                batches.append(current)
                current, new_longest = [], int(clipped[i])
            current.append(i)
            longest = new_longest
        if len(current) < min_rows and batches:
            batches[-1].extend(current)  # too few rows for every rank: ride with the batch before
        elif current:
            batches.append(current)
    if min_rows > 1 and sum(len(b) for b in batches) < min_rows:
        raise ValueError(f"{len(lengths)} samples cannot give each of {min_rows} data-parallel ranks (x "
                         "--grad-accum micro-batches) a row; use fewer workers, a smaller --grad-accum or more data")
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(samples: list[tuple[Tensor, ...]], *, pad_to: int = 0, hidden_size: int = 0,
            key_width: int = 0, pin: bool = False) -> Batch:
    """Pad to the longest sample (or `pad_to` if longer: data-parallel micro-batches share the global
    batch's length). `hidden_size` (and `key_width` for fused keys) give the widths when `samples` is empty.
    States keep the samples' dtype. `pin`: page-locked host memory, from which a copy to a GPU runs
    asynchronously (from pageable memory it is staged and waits)."""
    B = len(samples)
    L = max([int(s[0].shape[0]) for s in samples] + [pad_to])
    d = samples[0][2].shape[-1] if samples else hidden_size
    fused = samples[0][3].shape[-1] if samples and len(samples[0]) > 3 else key_width
    dtype = samples[0][2].dtype if samples else torch.float32
    ids = torch.zeros(B, L, dtype=torch.long, pin_memory=pin)
    mask = torch.zeros(B, L, dtype=torch.bool, pin_memory=pin)
    hidden = torch.zeros(B, L, d, dtype=dtype, pin_memory=pin)
    key_states = torch.zeros(B, L, fused, dtype=dtype, pin_memory=pin) if fused else None
    lengths = torch.zeros(B, dtype=torch.long, pin_memory=pin)
    for b, (i, m, h, *keys) in enumerate(samples):
        n = i.shape[0]
        ids[b, :n], mask[b, :n], hidden[b, :n], lengths[b] = i, m, h, n
        if keys:
            key_states[b, :n] = keys[0]
    return Batch(ids, mask, hidden, lengths, key_states=key_states,
                 token_count=sum(int(s[0].shape[0]) for s in samples))


class Loader:
    """Yields (batch_index, Batch, wait_seconds) from `start`, reading the next batch in a thread
    while the current one trains. wait_seconds is how long the trainer waited for data.

    shard=(rank, world_size): read only this rank's contiguous slice of each batch (data parallel).
    device: where the batches go. For a CUDA device they are read in the store's dtype into pinned memory
    (bf16 crosses at half the bytes of fp32, asynchronously) and cast on the GPU; for the CPU they are cast
    to fp32 here, in the reading thread, off the training thread."""

    def __init__(self, data: StoreSet, plan: list[list[int]], *, limit: int, start: int = 0,
                 shard: tuple[int, int] = (0, 1), device: torch.device | None = None) -> None:
        self.data, self.plan, self.limit, self.start, self.shard = data, plan, limit, start, shard
        self.to_gpu = device is not None and device.type == "cuda"

    def _samples(self, rows: list[int]) -> list[tuple[Tensor, ...]]:
        return [self.data.sample(i, self.limit, as_stored=self.to_gpu) for i in rows]

    def _read(self, index: int) -> Batch:
        rows = self.plan[index]
        rank, world = self.shard
        if world == 1:
            return collate(self._samples(rows), pin=self.to_gpu)
        from beagle.distributed import shard_bounds

        lo, hi = shard_bounds(len(rows), rank, world)
        longest = max(min(int(self.data.lengths[i]), self.limit) for i in rows)
        key_layers = self.data.key_layers
        key_width = 0 if key_layers == (-1,) else len(key_layers) * self.data.hidden_size
        batch = collate(self._samples(rows[lo:hi]), pad_to=longest, hidden_size=self.data.hidden_size,
                        key_width=key_width, pin=self.to_gpu)
        batch.row_start, batch.global_rows = lo, len(rows)
        return batch

    def __iter__(self) -> Iterator[tuple[int, Batch, float]]:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="beagle-data") as pool:
            pending = pool.submit(self._read, self.start) if self.start < len(self.plan) else None
            for index in range(self.start, len(self.plan)):
                t0 = time.perf_counter()
                batch = pending.result()
                wait = time.perf_counter() - t0
                pending = pool.submit(self._read, index + 1) if index + 1 < len(self.plan) else None
                yield index, batch, wait
