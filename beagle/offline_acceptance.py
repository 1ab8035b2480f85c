"""Offline chain acceptance of a drafter on stored target states: per-depth α and τ without the target model.

For every root n of a sample the drafter drafts a chain of `depth` tokens from the true states h_0..h_n,
feeding back its own states. Depth j is accepted when its draft top-1 equals the target's greedy token
argmax LMHead(h_{n+j}) and every shallower depth was accepted; we also require that greedy token to be the
data token, so the chain stays on the stored sequence (whose states we have).
τ = 1 + mean accepted length (bonus token included), α_j = accepted at j ÷ accepted at j-1.

Why here and not only in bench: the trainer's held-out validation (`train --val-samples`) reports the
same numbers every `--eval-every` steps, and the bench scripts (bench/acceptance.py) call this module, so a
τ in metrics.jsonl and a τ in docs/benchmarks.md are one estimator. It needs no decoding loop, so Beagle
(both forms) and EAGLE-2 are measured identically. Counts are integers: summed over batches and ranks
they give exactly the τ of one pass over all the samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from beagle.data import Batch, StoreSet, collate
from beagle.losses import GPU_VOCAB_CHUNK
from beagle.registry import form_of
from beagle.stages import StageSettings, simulate

# Rows per LM-head matmul when taking top-1 tokens: bounds the [rows, V] logits of a long batch
# (4,096 rows of a 128k vocabulary would be 2 GB in fp32). One sample of bench's 512 tokens is one chunk.
TOP1_ROWS = 4096


@dataclass(frozen=True)
class Acceptance:
    """Chain acceptance counts. accepted[j] = roots whose chain reached depth j (accepted[0]: every root)."""

    accepted: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.accepted) - 1

    @property
    def roots(self) -> int:
        return self.accepted[0]

    @property
    def tau(self) -> float:
        """1 + mean accepted length: Σ_n a_n = Σ_{j>=1} accepted[j]."""
        return 1.0 + sum(self.accepted[1:]) / max(1, self.roots)

    @property
    def alphas(self) -> list[float]:
        """[α_1..α_depth]: the share of chains reaching depth j-1 that also accept depth j (0 where none did)."""
        a = self.accepted
        return [a[j] / a[j - 1] if a[j - 1] else 0.0 for j in range(1, len(a))]


def top1_tokens(model: nn.Module, hidden: Tensor, vocab: Tensor | None) -> Tensor:
    """Draft top-1 token ids [B, L] from states [B, L, d], over `vocab` [N] only when given."""
    B, L, d = hidden.shape
    if B * L > TOP1_ROWS:
        rows = hidden.reshape(B * L, 1, d)
        return torch.cat([top1_tokens(model, rows[i:i + TOP1_ROWS].transpose(0, 1), vocab)[0]
                          for i in range(0, B * L, TOP1_ROWS)]).reshape(B, L)
    if vocab is None:
        return model.logits(hidden).argmax(-1)
    return vocab[(model.head_input(hidden) @ model.lm_head[vocab].to(hidden.dtype).T).argmax(-1)]


def greedy_tokens(hidden: Tensor, lm_head: Tensor) -> Tensor:
    """The target's greedy next token at every row, [B, L], from its states [B, L, d] and LM head [V, d]."""
    B, L, d = hidden.shape
    rows = hidden.reshape(B * L, d)
    return torch.cat([(rows[i:i + TOP1_ROWS].to(lm_head.dtype) @ lm_head.T).argmax(-1)
                      for i in range(0, B * L, TOP1_ROWS)]).reshape(B, L)


def beagle_chain_tokens(model: nn.Module, batch: Batch, depth: int, vocab: Tensor | None = None) -> dict[int, Tensor]:
    """{offset: draft top-1 [B, L] where row p holds the token drafted at p's depth in windows of `depth`}.

    Training's stage-2 simulation without noise, once per window offset: every root of a sample is a
    window start for exactly one offset. Both Beagle forms (the state residual carries its own state)."""
    settings = StageSettings(window_size=depth, simulation_steps=depth,
                             noise_std=0.0, regression_weight=10.0, vocab_chunk=GPU_VOCAB_CHUNK,
                             recompute=False)  # no loss is computed: the chunk is never used
    out = {}
    for offset in range(depth):
        tokens = torch.full(batch.input_ids.shape, -1, dtype=torch.long, device=batch.input_ids.device)
        for _, q_pos, (hidden,) in simulate(model, batch, offset, settings):
            tokens[:, q_pos] = top1_tokens(model, hidden, vocab)
        out[offset] = tokens
    return out


def chain_tokens(model: nn.Module, batch: Batch, depth: int, vocab: Tensor | None = None) -> dict[int, Tensor]:
    """The drafted chains of any drafter form, in `beagle_chain_tokens`' layout (the form's `offline_chain`)."""
    return form_of(model).chain_tokens()(model, batch, depth, vocab)


@torch.no_grad()
def batch_acceptance(model: nn.Module, batch: Batch, lm_head: Tensor, *, depth: int,
                     vocab: Tensor | None = None) -> Tensor:
    """Acceptance counts [depth + 1] (long, on the batch's device: no host sync) of a padded batch.

    lm_head [V, d]: the target's head the greedy tokens come from. Roots n of a sample of length L_b are
    n = offset - 1 + m·depth for each window offset, n >= 0 and n < L_b - depth - 1 (each root's chain
    lies inside the sample, with a data token after it)."""
    B, L = batch.input_ids.shape
    dev = batch.input_ids.device
    greedy = greedy_tokens(batch.hidden, lm_head)                                         # [B, L]
    on_data = torch.zeros(B, L, dtype=torch.bool, device=dev)
    on_data[:, :-1] = greedy[:, :-1] == batch.input_ids[:, 1:]                            # greedy is the data token
    levels = torch.arange(depth + 1, device=dev)                                          # [depth + 1]
    counts = torch.zeros(depth + 1, dtype=torch.long, device=dev)
    for offset, drafted in chain_tokens(model, batch, depth, vocab).items():
        roots = torch.arange(offset - 1, L - depth - 1, depth, device=dev)
        roots = roots[roots >= 0]                                                         # [R]
        if roots.numel() == 0:
            continue
        window = roots[:, None] + 1 + torch.arange(depth, device=dev)                     # [R, depth]
        hit = (drafted[:, window] == greedy[:, window]) & on_data[:, window]              # [B, R, depth]
        accepted = hit.long().cumprod(-1).sum(-1)                                         # [B, R] chain length
        valid = roots[None, :] < batch.lengths[:, None].to(dev) - depth - 1               # [B, R]
        counts += ((accepted[..., None] >= levels) & valid[..., None]).sum((0, 1))        # [depth + 1]
    return counts


def chain_acceptance(model: nn.Module, batches: Iterable[Batch], lm_head: Tensor, *, depth: int,
                     vocab: Tensor | None = None) -> Acceptance:
    """Acceptance of `model` over `batches` (one host sync at the end). `vocab` [N] restricts drafting to a
    reduced vocabulary, as `eval` does for a drafter trained with one."""
    counts = torch.zeros(depth + 1, dtype=torch.long)
    for batch in batches:
        counts += batch_acceptance(model, batch, lm_head, depth=depth, vocab=vocab).cpu()
    return Acceptance(tuple(int(c) for c in counts.tolist()))


def store_acceptance(model: nn.Module, data: StoreSet, indices: Iterable[int], *, depth: int = 5, limit: int = 512,
                     vocab: Tensor | None = None) -> Acceptance:
    """Acceptance over samples `indices` of `data`, one sample per batch (no padding), in fp32 against the
    stores' own LM head: what the bench scripts report."""
    lm_head = data.load_head()["lm_head"].float()
    return chain_acceptance(model, (collate([data.sample(i, limit)]) for i in indices), lm_head, depth=depth,
                            vocab=vocab)
