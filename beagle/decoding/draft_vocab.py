"""A reduced draft vocabulary: the drafter's LM head scores only the most frequent tokens (docs/method.md §4.2, §8).

On a CPU a draft step is mostly the LM head (V x d weights read per step: 49k x 576 for SmolLM2), so
scoring only the N most frequent predicted tokens of the training stores makes each step several times
cheaper. Outputs stay exact: the target still decides every token (greedy), and for sampling the
drafter's distribution is simply zero outside the subset, which rejection sampling allows.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor, nn

from beagle.decoding.packed_linear import pack_for_decoding
from beagle.errors import SettingsError

logger = logging.getLogger(__name__)


def frequent_tokens(stores: list, size: int, vocab_size: int, always: set[int] = frozenset(),
                    exclude: list[set[int]] | None = None) -> Tensor:
    """The `size` tokens most often predicted (loss-masked positions) in the stores (URLs or opened
    FeatureStores), plus `always` ids. Deterministic: ties go to the smaller id, so the trainer and
    `eval` pick the same tokens from the same stores. `exclude`: per store, sample indices not counted
    (a run's held-out validation samples)."""
    from pipeline.store import open_store

    counts = np.zeros(vocab_size, dtype=np.int64)
    for number, store in enumerate(stores):
        store = open_store(store) if isinstance(store, str) else store
        skip = exclude[number] if exclude else set()
        for index in range(len(store)):
            if index in skip:
                continue
            ids, mask = store.get_tokens(index)
            ids, mask = np.asarray(ids), np.asarray(mask).astype(bool)
            counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    if not counts.any():
        raise ValueError("no loss-masked tokens in the stores; cannot choose a draft vocabulary")
    order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, ties by id
    chosen = set(int(t) for t in order[:size]) | {int(t) for t in always}
    covered = counts[sorted(chosen)].sum() / counts.sum()
    logger.info("draft vocabulary: %d tokens cover %.1f%% of predicted tokens", len(chosen), 100 * covered)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def trained_vocabulary(drafter: nn.Module, tokens: list[int], eos: set[int]) -> "ReducedVocabDrafter":
    """Draft over the vocabulary the drafter's token loss was trained on (`train --draft-vocab`, listed
    in its config.json), plus the EOS ids so that a draft can end. Outside it the drafter's logits were
    never trained, so drafting over the full vocabulary would pick untrained tokens."""
    vocab = drafter.config.vocab_size
    bad = [t for t in tokens if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"the drafter's config.json lists draft_vocab ids {bad[:5]} outside the target's "
                         f"vocabulary of {vocab}; the drafter was trained for another target")
    return ReducedVocabDrafter(drafter, torch.tensor(sorted({int(t) for t in tokens} | set(eos))))


def select_draft_vocabulary(drafter: nn.Module, meta: dict, size: int | None, stores: list[str],
                            eos: set[int]) -> tuple[nn.Module, str | None]:
    """The drafter `eval` and `bench/decode.py` draft with, and a line saying which vocabulary it scores.

    size N > 0: the N tokens most often predicted in `stores` (default: the drafter's training stores);
    None: the vocabulary it was trained on (`train --draft-vocab`) when it has one, else all; 0: all.
    Its linear layers are packed for the CPU's bf16 units where that gives identical results
    (`packed_linear.py`): the returned drafter is for decoding, not for training."""
    drafter, note = _with_draft_vocabulary(drafter, meta, size, stores, eos)
    pack_for_decoding(drafter)
    return drafter, note


def _with_draft_vocabulary(drafter: nn.Module, meta: dict, size: int | None, stores: list[str],
                           eos: set[int]) -> tuple[nn.Module, str | None]:
    if size:
        stores = list(stores) or list(meta.get("stores") or [])
        if not stores:
            raise SettingsError("--draft-vocab counts tokens in the training stores, and the drafter's config.json "
                             "lists none: pass --draft-vocab-store STORE")
        reduced = ReducedVocabDrafter(drafter, frequent_tokens(stores, size, drafter.config.vocab_size, always=eos))
        return reduced, f"drafting over the {reduced.tokens.numel()} most frequent predicted tokens"
    if size is None and meta.get("draft_vocab"):
        reduced = trained_vocabulary(drafter, meta["draft_vocab"], eos)
        return reduced, (f"drafting over the {reduced.tokens.numel()}-token vocabulary the drafter was trained "
                         "on (--draft-vocab 0 for all)")
    return drafter, None


class ReducedVocabDrafter(nn.Module):
    """A view of any drafter form whose logits are computed for `tokens` only (every other token gets -inf).

    It composes rather than forwards: whatever it does not define itself (the form's decoding interface, its
    config, `drafter_type`, `carries_state`, `layer_fusion`) is the wrapped drafter's own attribute, so a new
    form needs nothing here. `draft_columns` (the Drafter protocol, beagle/registry.py) names its columns."""

    def __init__(self, drafter: nn.Module, tokens: Tensor) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("tokens", tokens.to(drafter.lm_head.device), persistent=False)
        # The subset's rows of the LM head [N, d], in the drafter's dtype, as a frozen linear layer (which
        # decoding may pack for the CPU's bf16 units, beagle/decoding/packed_linear.py).
        rows = drafter.lm_head[self.tokens].to(next(drafter.parameters()).dtype)
        self.head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        self.head.weight = nn.Parameter(rows.contiguous(), requires_grad=False)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # its own parameters, buffers and modules
        except AttributeError:
            return getattr(super().__getattr__("drafter"), name)

    @property
    def draft_columns(self) -> Tensor:
        """[N]: the token id of each column `compact_logits` returns."""
        return self.tokens

    def compact_logits(self, hidden: Tensor) -> Tensor:
        """[B, Lq, d] -> [B, Lq, N]: logits of the subset, column j for token `tokens[j]`."""
        return self.head(self.drafter.head_input(hidden).to(self.head.weight.dtype))

    def logits(self, hidden: Tensor) -> Tensor:
        """[B, Lq, d] -> [B, Lq, V], scored on the subset only (every other token -inf)."""
        subset = self.compact_logits(hidden)  # [B, Lq, N]
        full = subset.new_full((*subset.shape[:-1], self.drafter.config.vocab_size), float("-inf"))
        full[..., self.tokens] = subset
        return full
