"""Offline chain acceptance for the bench scripts: the estimator itself is `beagle.offline_acceptance`
(also what `train --val-samples` reports), so τ here and in a run's metrics.jsonl are one rule.

What stays here is bench-only: reading a store by URL, scoring an exported drafter, and the depth-1
guessers of bench/depth1.py (a bigram table, a drafter with ablated keys) scored by the chain's depth-1 rule.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from beagle.data import Batch, StoreSet, collate
from beagle.drafter_folder import load_drafter
from beagle.model import BeagleDrafter
from beagle.offline_acceptance import beagle_chain_tokens, store_acceptance


@torch.inference_mode()
def chain_acceptance(model, store_url: str, *, depth: int = 5, samples: int = 16, limit: int = 512,
                     first: int = 0, vocab: torch.Tensor | None = None) -> tuple[float, list[float]]:
    """(τ, [α_1..α_depth]) over `samples` samples of the store starting at index `first` (wrapping around);
    `vocab` [N] restricts drafting to a reduced vocabulary (as `eval` does for a drafter trained with one)."""
    data = StoreSet([store_url], key_layers=model.config.key_layers)
    indices = [i % len(data) for i in range(first, first + samples)]
    result = store_acceptance(model, data, indices, depth=depth, limit=limit, vocab=vocab)
    return result.tau, result.alphas


Predictor = Callable[[int, Batch], torch.Tensor]  # (sample index, its batch) -> draft ids [L]: row p guesses t_{p+1}


@torch.inference_mode()
def depth1_acceptance(predict: Predictor, store_url: str, *, samples: int | None = None, limit: int = 512) -> float:
    """α1 of any next-token guesser by `chain_acceptance`'s depth-1 rule: the guess at row n+1 must equal the
    target's greedy token there, and that token must be the data token. Counted over roots n = 0..L-3 of
    every sample (or the first `samples`), as a chain of depth 1 counts them; a bigram table and a drafter
    with ablated keys are scored by the same rule as the drafters."""
    data = StoreSet([store_url])
    head = data.load_head()
    accepted = roots = 0
    for i in range(len(data) if samples is None else min(samples, len(data))):
        batch = collate([data.sample(i, limit)])
        L = int(batch.lengths[0])
        if L < 3:
            continue
        greedy = (batch.hidden[0, :L] @ head["lm_head"].float().T).argmax(-1)            # [L]
        guess = predict(i, batch)[:L]                                                     # [L]
        n = torch.arange(L - 2)
        hit = (guess[n + 1] == greedy[n + 1]) & (greedy[n + 1] == batch.input_ids[0, n + 2])
        accepted += int(hit.sum())
        roots += L - 2
    return accepted / max(1, roots)


def bigram_predictor(store_url: str, *, limit: int = 512) -> Predictor:
    """The most frequent next token of each token in `store_url` (a bigram table counted over every token of
    every sample): what a drafter that reads only its query token could learn from that store at best."""
    data = StoreSet([store_url])
    vocab_size = int(data.target["architecture"]["vocab_size"])
    pairs = []
    for i in range(len(data)):
        ids = torch.as_tensor(data.sample(i, limit)[0], dtype=torch.long)
        pairs.append(ids[:-1] * vocab_size + ids[1:])                                     # [L-1] (t, next)
    seen, counts = torch.unique(torch.cat(pairs), return_counts=True)
    by_count = torch.sort(counts, descending=True, stable=True).indices
    first, following = seen[by_count] // vocab_size, seen[by_count] % vocab_size
    by_token = torch.sort(first, stable=True).indices     # per token, its most frequent pair comes first
    first, following = first[by_token], following[by_token]
    _, group_sizes = torch.unique_consecutive(first, return_counts=True)
    starts = torch.cumsum(group_sizes, 0) - group_sizes
    table = torch.full((vocab_size,), -1, dtype=torch.long)                               # [V]; -1: never seen
    table[first[starts]] = following[starts]
    return lambda index, batch: table[batch.input_ids[0]]


def beagle_depth1_predictor(model: BeagleDrafter, vocab: torch.Tensor | None = None,
                            keys: Callable[[int, Batch], torch.Tensor] | None = None) -> Predictor:
    """Depth-1 guesses of a last-layer Beagle drafter (every row drafts from the true states before it).
    `keys` maps (sample index, batch) to other states [1, L, d] to make its keys from (an ablation: the
    store's mean state, another sample's states), while the greedy tokens it is scored against stay the
    true ones."""
    if model.config.fused:
        raise ValueError("depth-1 key ablations are for last-layer drafters; this one fuses several layers")

    def predict(index: int, batch: Batch) -> torch.Tensor:
        if keys is not None:
            batch = dataclasses.replace(batch, hidden=keys(index, batch))
        return beagle_chain_tokens(model, batch, 1, vocab)[0][0]
    return predict


def score_drafter(drafter_dir: str, store_url: str, head: dict[str, torch.Tensor], *, samples: int,
                  limit: int, depth: int = 5) -> tuple[float, list[float]]:
    """(τ, α per depth) of an exported drafter over the first `samples` samples of `store_url`, drafting
    over its trained vocabulary as `eval` does; `head` is the store's embedding and LM head."""
    model, meta = load_drafter(drafter_dir, embed_tokens=head["embed_tokens"].float(), lm_head=head["lm_head"].float())
    vocab = torch.tensor(meta["draft_vocab"]) if meta.get("draft_vocab") else None
    return chain_acceptance(model, store_url, depth=depth, samples=samples, limit=limit, vocab=vocab)
