"""Draft trees: the EAGLE-2 dynamic tree built with the Beagle drafter (a chain is the top-1 case).

Tree positions: 0 is the root, the token the target already chose but has not yet processed (position
`n+1` in the sequence); 1..N are drafted tokens, parents before children, and siblings in order of
decreasing score. A node at depth j sits at sequence position `root_position + j`.

Expansion (EAGLE-2): at each depth the `top_k` frontier nodes with the best cumulative log-probability are
run through the drafter and each proposes its `top_k` best children; after `depth` drafter steps the best
`total_tokens` nodes of everything proposed are kept. A child never scores above its parent, so the kept
set is closed under ancestors (ties go to the earlier-proposed, shallower node).

Sampling (temperature > 0): children are drawn without replacement from the drafter's distribution
(Gumbel top-k) and ranked by their perturbed path score with the truncated-Gumbel construction of
stochastic beam search (Kool et al., 2019). A node's perturbed score is independent of which token it is
given its elder siblings, so which nodes survive never biases which tokens are proposed; with the
recursive rejection sampling in `acceptance.py` the output follows the target's distribution exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftConfig:
    """How to draft. A chain is `top_k=1, total_tokens=depth`."""

    depth: int = 5
    top_k: int = 10
    total_tokens: int = 60
    temperature: float = 0.0
    concatenate: bool = True  # drafted states become keys for their descendants (spec §5)
    # Greedy only: keep a drafted token only while the drafter's probability for its whole path is at least
    # this much, and stop drafting once no path is. 0 keeps the method's fixed-size tree. A weak drafter on a
    # target whose verification costs more per token (CPUs) then spends drafts only where they pay.
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth={self.depth}: draft at least one token (--depth >= 1)")
        if self.top_k < 1:
            raise ValueError(f"top_k={self.top_k}: expand at least one child (--top-k >= 1)")
        if self.total_tokens < 1:
            raise ValueError(f"total_tokens={self.total_tokens}: keep at least one node (--total-tokens >= 1)")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: use 0 for greedy or a positive value")
        if not 0 <= self.min_confidence <= 1:
            raise ValueError(f"min_confidence={self.min_confidence}: a probability in [0, 1] (--min-confidence)")
        if self.min_confidence > 0 and self.temperature > 0:
            raise ValueError("--min-confidence works with --temperature 0 only: dropping drafted tokens by their "
                             "probability would bias rejection sampling")

    @classmethod
    def chain(cls, depth: int = 5, temperature: float = 0.0, concatenate: bool = True,
              min_confidence: float = 0.0) -> "DraftConfig":
        return cls(depth=depth, top_k=1, total_tokens=depth, temperature=temperature, concatenate=concatenate,
                   min_confidence=min_confidence)

    @property
    def log_min_confidence(self) -> float:
        """The path log-probability below which drafted nodes are dropped (-inf: none are)."""
        return math.log(self.min_confidence) if self.min_confidence > 0 else -math.inf


@dataclass
class DraftTree:
    """A draft tree over `N+1` positions (0 = root). `draft_probs` maps a position that has children to
    the drafter's distribution there (kept only when sampling; rejection sampling needs it)."""

    tokens: torch.Tensor      # [N+1] long
    parents: torch.Tensor     # [N+1] long, parents[0] = -1
    depths: torch.Tensor      # [N+1] long, depths[0] = 0
    children: list[list[int]]
    draft_probs: dict[int, torch.Tensor]

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate on both ends."""
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _propose_children(log_q: torch.Tensor, phi: torch.Tensor, perturbed: torch.Tensor, top_k: int,
                      sample: bool, generator: torch.Generator | None):
    """Children of a batch of expanded nodes: tokens, path log-prob and ranking score, each `[n, top_k]`.

    Greedy ranks by path log-prob; sampling by the truncated-Gumbel perturbed path score.
    """
    paths = phi[:, None] + log_q  # [n, V]
    if not sample:
        scores, tokens = torch.topk(paths, top_k, dim=-1)
        return tokens, scores, scores
    uniform = torch.rand(paths.shape, generator=generator, device=paths.device).clamp_(min=1e-20)
    gumbel_paths = paths - torch.log(-torch.log(uniform))  # [n, V]
    top, tokens = torch.topk(gumbel_paths, top_k, dim=-1)
    maximum = top[:, :1]
    # Truncate the children's perturbed scores below the parent's (Kool et al., 2019, appendix B.3).
    v = perturbed[:, None] - top + _log1mexp(top - maximum)
    truncated = perturbed[:, None] - torch.relu(v) - torch.log1p(torch.exp(-v.abs()))
    return tokens, torch.gather(paths, 1, tokens), truncated


def build_draft_tree(backend, root_token: int, root_position: int, config: DraftConfig,
                     generator: torch.Generator | None = None) -> DraftTree:
    """Draft a tree after the root token. `backend` (see `drafters.py`) wraps the drafter and its cache
    of keys for the committed positions < root."""
    true_keys, true_values = backend.keys(), backend.values()  # [1, H_kv, L, hd]
    device = true_keys.device
    num_true = true_keys.shape[-2]
    sample = config.temperature > 0
    scale = 1.0 / config.temperature if sample else 1.0
    concatenate = backend.concatenate and config.depth > 1
    parent_states = backend.root_parent_states()  # [1, q, d] or None

    # Every proposed node, in proposal order (id 0 = root): token, parent id, depth, ranking score.
    node_tokens = [torch.tensor([root_token], device=device)]
    node_parents = [torch.tensor([-1], device=device)]
    node_depths = [torch.zeros(1, dtype=torch.long, device=device)]
    node_scores = [torch.zeros(1, device=device)]
    draft_probs: dict[int, torch.Tensor] = {}

    bank_keys = bank_values = None          # drafted states as keys: [1, H_kv, S, hd]
    visible_below: torch.Tensor | None = None  # [#expanded, S] bank slots a child of each expanded node sees
    expanded_ids = torch.zeros(1, dtype=torch.long, device=device)  # node ids run at this step
    query_tokens = node_tokens[0]
    query_bank_mask = None
    phi = torch.zeros(1, device=device)
    perturbed = torch.zeros(1, device=device)
    next_id = 1
    frontier = None

    for step in range(config.depth):
        num_queries = query_tokens.shape[0]
        positions = torch.full((1, num_queries), root_position + step, dtype=torch.long, device=device)
        mask = torch.ones(1, 1, num_queries, num_true, dtype=torch.bool, device=device)
        keys, values = true_keys, true_values
        if concatenate and bank_keys is not None:
            keys = torch.cat([true_keys, bank_keys], dim=-2)
            values = torch.cat([true_values, bank_values], dim=-2)
            mask = torch.cat([mask, query_bank_mask[None, None]], dim=-1)  # [1, 1, q, L + S]
        hidden, bank = backend.step(query_tokens[None], positions, parent_states, keys, values, mask,
                                    need_bank=step + 1 < config.depth)  # [1, q, d]
        log_q = torch.log_softmax(backend.logits(hidden)[0].float() * scale, dim=-1)  # [q, V]
        if sample:
            for row, node_id in enumerate(expanded_ids.tolist()):
                draft_probs[node_id] = log_q[row].exp()
        if step + 1 < config.depth and concatenate:
            new_keys, new_values = bank  # [1, H_kv, q, hd] each: keys for the queries' descendants
            first_slot = 0 if bank_keys is None else bank_keys.shape[-2]
            bank_keys = new_keys if bank_keys is None else torch.cat([bank_keys, new_keys], dim=-2)
            bank_values = new_values if bank_values is None else torch.cat([bank_values, new_values], dim=-2)
            own = torch.zeros(num_queries, bank_keys.shape[-2], dtype=torch.bool, device=device)
            own[torch.arange(num_queries, device=device), first_slot + torch.arange(num_queries, device=device)] = True
            if query_bank_mask is not None:
                own[:, :query_bank_mask.shape[-1]] |= query_bank_mask
            visible_below = own  # row r: what children of the r-th query see

        tokens, paths, scores = _propose_children(log_q, phi, perturbed, config.top_k, sample, generator)
        count = tokens.numel()
        ids = torch.arange(next_id, next_id + count, device=device)
        next_id += count
        node_tokens.append(tokens.reshape(-1))
        node_parents.append(expanded_ids[:, None].expand_as(tokens).reshape(-1))
        node_depths.append(torch.full((count,), step + 1, dtype=torch.long, device=device))
        node_scores.append(scores.reshape(-1))
        frontier = (ids, tokens.reshape(-1), paths.reshape(-1), scores.reshape(-1),
                    torch.arange(num_queries, device=device)[:, None].expand_as(tokens).reshape(-1))
        confident = int((paths >= config.log_min_confidence).sum())  # greedy: paths are the scores
        if step + 1 == config.depth or confident == 0:
            break
        # Expand the best top_k of the newest depth (only confident ones: a child never beats its parent).
        ids, toks, paths, scores, parent_rows = frontier
        best = torch.topk(scores, min(config.top_k, confident)).indices.sort().values
        expanded_ids, query_tokens = ids[best], toks[best]
        phi, perturbed = paths[best], scores[best]
        parent_states = hidden[:, parent_rows[best]]  # [1, k, d]
        if concatenate:
            query_bank_mask = visible_below[parent_rows[best]]

    return _select_nodes(node_tokens, node_parents, node_depths, node_scores, draft_probs, config.total_tokens,
                         config.log_min_confidence)


def _select_nodes(node_tokens, node_parents, node_depths, node_scores, draft_probs, total_tokens,
                  min_score: float = -math.inf) -> DraftTree:
    """Keep the root and the `total_tokens` best proposed nodes scoring at least `min_score`; renumber
    them into tree positions."""
    tokens = torch.cat(node_tokens)
    parents = torch.cat(node_parents)
    depths = torch.cat(node_depths)
    scores = torch.cat(node_scores)
    order = torch.sort(scores[1:], descending=True, stable=True).indices + 1
    total_tokens = min(total_tokens, int((scores[1:] >= min_score).sum()))
    kept = torch.cat([torch.zeros(1, dtype=torch.long, device=tokens.device),
                      order[:total_tokens].sort().values])  # proposal order: parents first
    position_of = {node_id: position for position, node_id in enumerate(kept.tolist())}
    kept_parents = [-1] + [position_of[p] for p in parents[kept[1:]].tolist()]
    children: list[list[int]] = [[] for _ in kept_parents]
    for position, parent in enumerate(kept_parents[1:], start=1):
        children[parent].append(position)
    probs = {position_of[i]: p for i, p in draft_probs.items() if i in position_of and children[position_of[i]]}
    return DraftTree(tokens=tokens[kept], parents=torch.tensor(kept_parents, device=tokens.device),
                     depths=depths[kept], children=children, draft_probs=probs)
