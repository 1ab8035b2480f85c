"""Which drafted tokens the target accepts, and the token it adds (docs/method.md §5.3, §5.4).

Both rules walk the tree from the root. At each node the target's own next-token distribution (from the
verification pass at that node) decides among the node's children:

* greedy: follow the child whose token equals the target's argmax; when none does, stop and commit the
  argmax itself (the bonus token). The committed tokens are exactly what plain greedy decoding produces.
* sampling: recursive rejection sampling over the children, which were drawn without replacement from
  the drafter's distribution q (SpecInfer / EAGLE, in the without-replacement form of Jeon et al., 2024).
  Child x is accepted with probability min(1, p(x)/q(x)); on rejection the target's distribution becomes
  the residual norm(max(p - q, 0)) and x is removed from q. When every child is rejected the bonus token is
  drawn from the residual, so each committed token follows the target's distribution exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from beagle.decoding.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """Accepted tree positions (excluding the root), the bonus token, whether the last accepted node had
    children the target could have accepted (a leaf ends the walk without a try at the next depth), and the
    accepted tokens, already on the host (the caller commits them without reading the device again)."""

    path: list[int]
    bonus_token: int
    tried_next_depth: bool
    tokens: list[int] = field(default_factory=list)


def greedy_accept(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """Longest path whose tokens match the target's argmax, plus the target's bonus token.

    The round's one read of the device: the target's choices and the drafted tokens, together."""
    # [2, N+1]: the target's greedy token after each position, and the tree's tokens
    choice, tokens = torch.stack([target_logits.argmax(dim=-1), tree.tokens.to(target_logits.device)]).tolist()
    path: list[int] = []
    node = 0
    while True:
        match = next((child for child in tree.children[node] if tokens[child] == choice[node]), None)
        if match is None:
            return Acceptance(path=path, bonus_token=choice[node], tried_next_depth=bool(tree.children[node]),
                              tokens=[tokens[position] for position in path])
        path.append(match)
        node = match


def sample_accept(tree: DraftTree, target_logits: torch.Tensor, temperature: float,
                  generator: torch.Generator | None = None) -> Acceptance:
    """Recursive rejection sampling down the tree; exact for the target at `temperature`."""
    target_probs = torch.softmax(target_logits.float() / temperature, dim=-1)  # [N+1, V]
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = 0
    while True:
        p = target_probs[node]
        children = tree.children[node]
        if children:
            q = tree.draft_probs[node].clone()
            for child in children:
                token = tokens[child]
                ratio = p[token] / q[token].clamp(min=1e-30)
                coin = torch.rand((), generator=generator, device=p.device)
                if coin < ratio:
                    break
                p = _normalise(torch.clamp(p - q, min=0), fallback=p)
                q[token] = 0
                q = _normalise(q, fallback=q)
            else:
                child = None
            if child is not None:
                path.append(child)
                node = child
                continue
        bonus = torch.multinomial(p, 1, generator=generator).item()
        return Acceptance(path=path, bonus_token=int(bonus), tried_next_depth=bool(children),
                          tokens=[tokens[position] for position in path])


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = weights.sum()
    return weights / total if total > 0 else fallback
