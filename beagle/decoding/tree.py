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
from dataclasses import dataclass, field

import torch

from beagle.errors import SettingsError, refuse_non_finite


@dataclass(frozen=True)
class DraftConfig:
    """How to draft. A chain is `top_k=1, total_tokens=depth`."""

    depth: int = 5
    top_k: int = 10
    total_tokens: int = 60
    temperature: float = 0.0
    concatenate: bool = True  # drafted states become keys for their descendants (docs/method.md §5.2)
    # Greedy only: keep a drafted token only while the drafter's probability for its whole path is at least
    # this much, and stop drafting once no path is. 0 keeps the method's fixed-size tree. A weak drafter on a
    # target whose verification costs more per token (CPUs) then spends drafts only where they pay.
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        if self.depth < 1:
            raise SettingsError(f"depth={self.depth}: draft at least one token (--depth >= 1)")
        if self.top_k < 1:
            raise SettingsError(f"top_k={self.top_k}: expand at least one child (--top-k >= 1)")
        if self.total_tokens < 1:
            raise SettingsError(f"total_tokens={self.total_tokens}: keep at least one node (--total-tokens >= 1)")
        if self.temperature < 0:
            raise SettingsError(f"temperature={self.temperature}: use 0 for greedy or a positive value")
        if not 0 <= self.min_confidence <= 1:
            raise SettingsError(f"min_confidence={self.min_confidence}: a probability in [0, 1] (--min-confidence)")
        if self.min_confidence > 0 and self.temperature > 0:
            raise SettingsError("--min-confidence works with --temperature 0 only: dropping drafted tokens by their "
                             "probability would bias rejection sampling")

    @classmethod
    def chain(cls, depth: int | None = None, temperature: float = 0.0, concatenate: bool = True,
              min_confidence: float = 0.0) -> "DraftConfig":
        """A top-1 chain of `depth` tokens (the class's default depth when None)."""
        depth = cls.depth if depth is None else depth
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


@dataclass
class _Proposals:
    """Every proposed node, in proposal order (id 0 = root): token, parent id, depth, ranking score; and,
    when sampling, the drafter's distribution at each expanded node."""

    tokens: list[torch.Tensor]
    parents: list[torch.Tensor]
    depths: list[torch.Tensor]
    scores: list[torch.Tensor]
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    next_id: int = 1

    @classmethod
    def root(cls, root_token: int, device: torch.device) -> "_Proposals":
        return cls(tokens=[torch.tensor([root_token], device=device)], parents=[torch.tensor([-1], device=device)],
                   depths=[torch.zeros(1, dtype=torch.long, device=device)], scores=[torch.zeros(1, device=device)])

    def add(self, tokens: torch.Tensor, expanded_ids: torch.Tensor, depth: int, scores: torch.Tensor) -> torch.Tensor:
        """Record the children `[n, top_k]` of the `n` expanded nodes; return their ids, flattened."""
        count = tokens.numel()
        ids = torch.arange(self.next_id, self.next_id + count, device=tokens.device)
        self.next_id += count
        self.tokens.append(tokens.reshape(-1))
        self.parents.append(expanded_ids[:, None].expand_as(tokens).reshape(-1))
        self.depths.append(torch.full((count,), depth, dtype=torch.long, device=tokens.device))
        self.scores.append(scores.reshape(-1))
        return ids

    def select(self, total_tokens: int, min_score: float) -> DraftTree:
        return _select_nodes(self.tokens, self.parents, self.depths, self.scores, self.draft_probs, total_tokens,
                             min_score)


@dataclass
class _KeyBank:
    """Drafted states kept as keys for their descendants (docs/method.md §5.2), and which of them each query sees.

    Their keys go into the drafter cache's buffer past its committed length (`KeyValueBuffer` scratch rows), so
    a draft step attends over one view of true and drafted keys, not a fresh concatenation of the whole cache;
    the next commit of true states overwrites them."""

    buffer: object                            # the drafter cache's KeyValueBuffer
    slots: int = 0                            # S: drafted keys written past the committed length
    query_mask: torch.Tensor | None = None    # [q, S] bank slots each query of this step sees
    visible_below: torch.Tensor | None = None  # [q, S] bank slots a child of each query of this step sees

    def attention_inputs(self, true_keys: torch.Tensor, true_values: torch.Tensor, num_queries: int):
        """Keys, values `[1, H_kv, L (+ S), hd]` and mask `[1, 1, q, L (+ S)]` for this step's queries."""
        length = true_keys.shape[-2]
        mask = torch.ones(1, 1, num_queries, length + self.slots, dtype=torch.bool, device=true_keys.device)
        if not self.slots:
            return true_keys, true_values, mask
        mask[0, 0, :, length:] = self.query_mask
        keys, values = self.buffer.view(self.slots)
        return keys, values, mask

    def append(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """Add this step's queries' states `[1, H_kv, q, hd]`: a query's children see it and what it saw."""
        num_queries = new_keys.shape[-2]
        first_slot = self.slots
        self.buffer.write(self.buffer.length + first_slot, new_keys, new_values)
        self.slots += num_queries
        rows = torch.arange(num_queries, device=new_keys.device)
        own = torch.zeros(num_queries, self.slots, dtype=torch.bool, device=new_keys.device)
        own[rows, first_slot + rows] = True
        if self.query_mask is not None:
            own[:, :self.query_mask.shape[-1]] |= self.query_mask
        self.visible_below = own  # row r: what children of the r-th query see

    def expand(self, parent_rows: torch.Tensor) -> None:
        """The next step's queries are children of these rows of this step's queries."""
        self.query_mask = self.visible_below[parent_rows]


def _over_vocabulary(probs: torch.Tensor, columns: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """`[V]` draft distribution from `[N]` probabilities over the scored columns (zero elsewhere)."""
    if columns is None:
        return probs
    return probs.new_zeros(vocab_size).index_copy_(0, columns, probs)


def build_draft_tree(backend, root_token: int, root_position: int, config: DraftConfig,
                     generator: torch.Generator | None = None) -> DraftTree:
    """Draft a tree after the root token. `backend` (see `drafters.py`) wraps the drafter and its cache
    of keys for the committed positions < root."""
    true_keys, true_values = backend.keys(), backend.values()  # [1, H_kv, L, hd]
    device = true_keys.device
    sample = config.temperature > 0
    scale = 1.0 / config.temperature if sample else 1.0
    concatenate = backend.concatenate and config.depth > 1
    parent_states = backend.root_parent_states()  # [1, q, d] or None
    columns = getattr(backend, "token_ids", None)  # [N] token id of each logit column, None: column = token id
    vocab_size = backend.drafter.config.vocab_size
    proposals = _Proposals.root(root_token, device)
    bank = _KeyBank(backend.cache.buffer)
    expanded_ids = torch.zeros(1, dtype=torch.long, device=device)  # node ids run at this step
    query_tokens = proposals.tokens[0]
    phi = torch.zeros(1, device=device)        # path log-prob of each expanded node
    perturbed = torch.zeros(1, device=device)  # its ranking score

    for step in range(config.depth):
        last = step + 1 == config.depth
        num_queries = query_tokens.shape[0]
        positions = torch.full((1, num_queries), root_position + step, dtype=torch.long, device=device)
        keys, values, mask = bank.attention_inputs(true_keys, true_values, num_queries)
        hidden, new_bank = backend.step(query_tokens[None], positions, parent_states, keys, values, mask,
                                        need_bank=not last)  # [1, q, d]
        log_q = torch.log_softmax(backend.logits(hidden)[0].float() * scale, dim=-1)  # [q, N]: V or draft vocab
        if sample:
            for row, node_id in enumerate(expanded_ids.tolist()):
                proposals.draft_probs[node_id] = _over_vocabulary(log_q[row].exp(), columns, vocab_size)
        if not last and concatenate:
            bank.append(*new_bank)  # keys for the queries' descendants

        children = min(config.top_k, log_q.shape[-1])  # a draft vocabulary smaller than top-k offers all it has
        tokens, paths, scores = _propose_children(log_q, phi, perturbed, children, sample, generator)
        if columns is not None:
            tokens = columns[tokens]  # logit columns -> token ids
        ids = proposals.add(tokens, expanded_ids, step + 1, scores)
        # greedy: paths are the scores. Without a gate every path qualifies: counted without reading the device
        confident = (tokens.numel() if config.log_min_confidence == -math.inf
                     else int((paths >= config.log_min_confidence).sum()))
        if last or confident == 0:
            break
        # Expand the best top_k of the newest depth (only confident ones: a child never beats its parent).
        parent_rows = torch.arange(num_queries, device=device)[:, None].expand_as(tokens).reshape(-1)
        tokens, paths, scores = tokens.reshape(-1), paths.reshape(-1), scores.reshape(-1)
        best = torch.topk(scores, min(config.top_k, confident)).indices.sort().values
        expanded_ids, query_tokens = ids[best], tokens[best]
        phi, perturbed = paths[best], scores[best]
        parent_states = hidden[:, parent_rows[best]]  # [1, k, d]
        if concatenate:
            bank.expand(parent_rows[best])

    if config.top_k == 1 and config.log_min_confidence == -math.inf:
        return _chain(proposals, config.total_tokens)
    return proposals.select(config.total_tokens, config.log_min_confidence)


def _chain(proposals: _Proposals, total_tokens: int) -> DraftTree:
    """The top-1 chain without a gate: the best `total_tokens` nodes are the shallowest (a child never scores
    above its parent, ties go to the earlier node), so the tree is known without reading the device."""
    size = min(total_tokens, proposals.next_id - 1) + 1
    tokens = torch.cat(proposals.tokens)[:size]
    device = tokens.device
    children = [[position + 1] for position in range(size - 1)] + [[]]
    probs = {position: p for position, p in proposals.draft_probs.items() if position < size - 1}
    return DraftTree(tokens=tokens, parents=torch.arange(-1, size - 1, device=device),
                     depths=torch.arange(size, device=device), children=children, draft_probs=probs)


def _select_nodes(node_tokens, node_parents, node_depths, node_scores, draft_probs, total_tokens,
                  min_score: float = -math.inf) -> DraftTree:
    """Keep the root and the `total_tokens` best proposed nodes scoring at least `min_score`; renumber
    them into tree positions. One read of the device (the kept ids and their parents), two with a gate."""
    tokens = torch.cat(node_tokens)
    parents = torch.cat(node_parents)
    depths = torch.cat(node_depths)
    scores = torch.cat(node_scores)
    order = torch.sort(scores[1:], descending=True, stable=True).indices + 1
    if min_score > -math.inf:
        total_tokens = min(total_tokens, int((scores[1:] >= min_score).sum()))
    kept = torch.cat([torch.zeros(1, dtype=torch.long, device=tokens.device),
                      order[:total_tokens].sort().values])  # proposal order: parents first
    kept_ids, parent_ids = torch.stack([kept, parents[kept]]).tolist()  # one read: ids and their parents
    position_of = {node_id: position for position, node_id in enumerate(kept_ids)}
    kept_parents = [-1] + [position_of[p] for p in parent_ids[1:]]
    children: list[list[int]] = [[] for _ in kept_parents]
    for position, parent in enumerate(kept_parents[1:], start=1):
        children[parent].append(position)
    probs = {position_of[i]: p for i, p in draft_probs.items() if i in position_of and children[position_of[i]]}
    return DraftTree(tokens=tokens[kept], parents=torch.tensor(kept_parents, device=tokens.device),
                     depths=depths[kept], children=children, draft_probs=probs)
