"""Offline chain acceptance of a drafter on stored target states, the same rule for Beagle and EAGLE-2.

For every root n of held-out samples the drafter drafts a chain of `depth` tokens from the true states
h_0..h_n, feeding back its own states. Depth j is accepted when its draft top-1 equals the target's
greedy token argmax LMHead(h_{n+j}) and every shallower depth was accepted; we also require that greedy
token to be the data token, so the chain stays on the stored sequence (whose states we have).
τ = 1 + mean accepted length (bonus token included), α_j = accepted at j ÷ accepted at j-1.
It needs no target model and no decoding loop, so both drafters are measured identically.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from beagle.data import Batch, StoreSet, collate
from beagle.eagle2 import Eagle2Drafter
from beagle.export import load_drafter
from beagle.model import BeagleDrafter, fuse_key_states
from beagle.stages import StageSettings, simulate


def _top1(model, hidden: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Draft top-1 token ids [B, L] from states [B, L, d], over `vocab` [N] only when given."""
    if vocab is None:
        return model.logits(hidden).argmax(-1)
    return vocab[(model.head_input(hidden) @ model.lm_head[vocab].to(hidden.dtype).T).argmax(-1)]


def _beagle_chain_tokens(model: BeagleDrafter, batch, depth: int, vocab=None) -> dict[int, torch.Tensor]:
    """{offset: draft top-1 [B, L] where row p holds the token drafted at p's depth in windows of `depth`}."""
    settings = StageSettings(window_size=depth, simulation_steps=depth,
                             noise_std=0.0, regression_weight=10.0, vocab_chunk=8192, recompute=False)
    out = {}
    for offset in range(depth):
        tokens = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
        for _, q_pos, (hidden,) in simulate(model, batch, offset, settings):
            tokens[:, q_pos] = _top1(model, hidden, vocab)
        out[offset] = tokens
    return out


def _eagle2_chain_tokens(model: Eagle2Drafter, batch, depth: int, vocab=None) -> dict[int, torch.Tensor]:
    """Same layout for EAGLE-2: at step j every row p drafts depth j for the root n = p - j."""
    B, L, d = batch.hidden.shape
    pos = torch.arange(L)
    positions = pos.expand(B, L)
    true = fuse_key_states(model, batch.key_input(model.config.reads_key_states))                  # [B, L, d]
    previous = torch.cat([true.new_zeros(B, 1, d), true[:, :-1]], dim=1)
    true_z = model.fuse(batch.input_ids, previous)
    k0, v0 = model.project_fused(true_z, positions)
    keys, values = [k0], [v0]
    parent = previous
    per_step = []
    for step in range(1, depth + 1):
        z = model.fuse(batch.input_ids, parent)
        k, v = model.project_fused(z, positions)
        keys.append(k)
        values.append(v)
        blocks = [(pos[None, :] <= pos[:, None] - step) & (pos[None, :] >= 1)]
        blocks += [pos[None, :] == pos[:, None] - step + i for i in range(1, step + 1)]
        valid = (pos[None, :] < batch.lengths[:, None]).repeat(1, step + 1)
        mask = torch.cat(blocks, dim=1)[None, None] & valid[:, None, None, :]
        hidden = model.attend(z, positions, torch.cat(keys, 2), torch.cat(values, 2), mask)  # [B, L, d]
        per_step.append(_top1(model, hidden, vocab))
        parent = torch.cat([hidden.new_zeros(B, 1, d), hidden[:, :-1]], dim=1)   # row p's parent: row p-1
    out = {}
    for offset in range(depth):
        tokens = torch.full((B, L), -1, dtype=torch.long)
        for step in range(1, depth + 1):
            rows = torch.arange((offset + step - 1) % depth, L, depth)
            tokens[:, rows] = per_step[step - 1][:, rows]
        out[offset] = tokens
    return out


@torch.inference_mode()
def chain_acceptance(model, store_url: str, *, depth: int = 5, samples: int = 16, limit: int = 512,
                     first: int = 0, vocab: torch.Tensor | None = None) -> tuple[float, list[float]]:
    """(τ, [α_1..α_depth]) over `samples` samples of the store starting at index `first`; `vocab` [N]
    restricts drafting to a reduced vocabulary (as `eval` does for a drafter trained with one)."""
    data = StoreSet([store_url], key_layers=model.config.key_layers)
    head = data.load_head()
    indices = [i % len(data) for i in range(first, first + samples)]
    accepted = [0] * (depth + 1)
    roots = 0
    lengths = []
    for i in indices:
        batch = collate([data.sample(i, limit)])
        L = int(batch.lengths[0])
        greedy = (batch.hidden @ head["lm_head"].float().T).argmax(-1)[0]           # [L]: target's next token
        on_data = torch.zeros(L, dtype=torch.bool)
        on_data[:-1] = greedy[:-1] == batch.input_ids[0, 1:]
        chains = (_eagle2_chain_tokens if isinstance(model, Eagle2Drafter) else _beagle_chain_tokens)(
            model, batch, depth, vocab)
        for offset, drafted in chains.items():
            for n in range(offset - 1, L - depth - 1, depth):
                if n < 0:
                    continue
                roots += 1
                a = 0
                while a < depth and drafted[0, n + a + 1] == greedy[n + a + 1] and on_data[n + a + 1]:
                    a += 1
                lengths.append(a)
                for j in range(a + 1):
                    accepted[j] += 1
    tau = 1.0 + sum(lengths) / max(1, len(lengths))
    alphas = [accepted[j] / accepted[j - 1] if accepted[j - 1] else 0.0 for j in range(1, depth + 1)]
    return tau, alphas


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
        return _beagle_chain_tokens(model, batch, 1, vocab)[0][0]
    return predict


def score_drafter(drafter_dir: str, store_url: str, head: dict[str, torch.Tensor], *, samples: int,
                  limit: int, depth: int = 5) -> tuple[float, list[float]]:
    """(τ, α per depth) of an exported drafter over the first `samples` samples of `store_url`, drafting
    over its trained vocabulary as `eval` does; `head` is the store's embedding and LM head."""
    model, meta = load_drafter(drafter_dir, embed_tokens=head["embed_tokens"].float(), lm_head=head["lm_head"].float())
    vocab = torch.tensor(meta["draft_vocab"]) if meta.get("draft_vocab") else None
    return chain_acceptance(model, store_url, depth=depth, samples=samples, limit=limit, vocab=vocab)
