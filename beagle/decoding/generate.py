"""Plain decoding and speculative decoding with a Beagle drafter, one sequence at a time.

Both loops share the same target calls (`verify.run_target`) so that their speed and their greedy
outputs can be compared honestly. Invariant of the speculative loop, at the top of each round: the target's
cache holds t_0..t_n, the drafter's cache holds the projected true states h_0..h_n, and `token` is
t_{n+1}, chosen by the target but not yet run through it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from beagle.decoding.acceptance import Acceptance, greedy_accept, sample_accept
from beagle.decoding.drafters import draft_backend
from beagle.decoding.kv_cache import cache_length, commit_path
from beagle.decoding.tree import DraftConfig, build_draft_tree
from beagle.decoding.verify import new_cache, run_target, verify_tree

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """New tokens and what it took to produce them.

    `target_passes` counts target forwards after the prefill (plain: one per token; speculative: one per
    verification). `accepted` lists, per round, how many drafted tokens the target accepted.
    """

    tokens: list[int]
    seconds: float
    target_passes: int = 0
    committed_by_passes: int = 0
    accepted: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's next token from logits `[V]`: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _finish(tokens: list[int], eos_token_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut after the first EOS or at the length limit; report whether generation is over."""
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in eos_token_ids:
            return tokens[:index + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def _check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: generate at least one token (--max-new-tokens >= 1)")


@torch.inference_mode()
def plain_generate(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int,
                   eos_token_ids: set[int], temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> GenerationResult:
    """Token-by-token decoding with a KV cache: the baseline speculative decoding must reproduce."""
    _check_budget(max_new_tokens)
    device = prompt_ids.device
    _synchronize(device)
    start = time.perf_counter()
    cache = new_cache(model, capacity=prompt_ids.shape[0] + max_new_tokens)
    output = run_target(model, cache, prompt_ids, hidden=False, last_logits_only=True)
    tokens, done = _finish([_choose(output.logits[-1], temperature, generator)], eos_token_ids, max_new_tokens)
    passes = 0
    while not done:
        output = run_target(model, cache, prompt_ids.new_tensor([tokens[-1]]), hidden=False, last_logits_only=True)
        passes += 1
        tokens, done = _finish(tokens + [_choose(output.logits[-1], temperature, generator)],
                               eos_token_ids, max_new_tokens)
    _synchronize(device)
    return GenerationResult(tokens=tokens, seconds=time.perf_counter() - start, target_passes=passes,
                            committed_by_passes=passes)


class SpeculativeSession:
    """The state of one speculative generation: both caches and the pending token t_{n+1}.

    Exposed (rather than hidden inside `speculative_generate`) so that tests can check the caches
    against a fresh forward pass after any number of rounds. `capacity`: the positions the answer may reach
    (prompt + new tokens); both caches are allocated for it plus one round's drafts, once.
    """

    def __init__(self, model: torch.nn.Module, drafter: torch.nn.Module, config: DraftConfig,
                 generator: torch.Generator | None = None, capacity: int = 0) -> None:
        self.model, self.drafter, self.config, self.generator = model, drafter, config, generator
        drafted = config.total_tokens + 1  # a verification pass writes the root and every node past the prefix
        self.cache = new_cache(model, capacity=capacity + drafted if capacity else 0)
        self.backend = draft_backend(drafter, config.concatenate)
        self.draft_cache = self.backend.cache
        if capacity:  # the draft steps' keys borrow the rows past the committed ones (tree.py's key bank)
            self.draft_cache.reserve(capacity + config.depth * config.top_k + 1)
        self.token: int | None = None
        self._drafter_dtype = next(drafter.parameters()).dtype
        self._key_layers = tuple(drafter.config.key_layers)

    def prefill(self, prompt_ids: torch.Tensor) -> int:
        """Run the prompt `[P]` through the target, seed the drafter's cache, return the first new token."""
        output = run_target(self.model, self.cache, prompt_ids, layers=self._key_layers, last_logits_only=True)
        positions = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
        self.backend.append(output.hidden.to(self._drafter_dtype), positions, prompt_ids)
        self.token = _choose(output.logits[-1], self.config.temperature, self.generator)
        return self.token

    def step(self) -> tuple[list[int], Acceptance]:
        """One round: draft a tree, verify it in one target pass, keep the accepted path in both caches.

        Returns the committed tokens (accepted drafts then the bonus token) and the `Acceptance`. Greedy, the
        round reads the device once for a chain (the acceptance) and twice for a tree (its shape, then the
        acceptance); nothing here copies a cache: the target's is rolled back by position, the accepted path
        of a tree moved into place row by row (kv_cache.py), and the drafter's is appended in place.
        """
        past = cache_length(self.cache)
        tree = build_draft_tree(self.backend, self.token, past, self.config, self.generator)
        output = verify_tree(self.model, self.cache, tree, past, self._key_layers)
        if self.config.temperature > 0:
            acceptance = sample_accept(tree, output.logits, self.config.temperature, self.generator)
        else:
            acceptance = greedy_accept(tree, output.logits)
        # Keep the root and the accepted path in both caches; the other branches are overwritten next round.
        commit_path(self.cache, past, acceptance.path)
        count = len(acceptance.path) + 1  # the root and the accepted nodes, at depths 0..m
        if acceptance.path == list(range(1, count)):  # a chain's accepted prefix: slices, no index to upload
            states, tokens = output.hidden[:count], tree.tokens[:count]
        else:
            kept = torch.tensor([0] + acceptance.path, device=tree.tokens.device)  # tree positions, depths 0..m
            states, tokens = output.hidden[kept], tree.tokens[kept]
        positions = past + torch.arange(count, device=tree.tokens.device)
        self.backend.append(states.to(self._drafter_dtype), positions, tokens)
        self.token = acceptance.bonus_token
        return acceptance.tokens + [acceptance.bonus_token], acceptance


@torch.inference_mode()
def speculative_generate(model: torch.nn.Module, drafter: torch.nn.Module, prompt_ids: torch.Tensor,
                         max_new_tokens: int, eos_token_ids: set[int], config: DraftConfig,
                         generator: torch.Generator | None = None) -> GenerationResult:
    """Draft a tree, verify it in one target pass, commit the accepted path plus the bonus token, repeat.

    Tokens past an EOS or the length limit inside an accepted draft are dropped, exactly where plain
    decoding would have stopped.
    """
    _check_budget(max_new_tokens)
    device = prompt_ids.device
    result = GenerationResult(tokens=[], seconds=0.0, depth_attempts=[0] * config.depth,
                              depth_accepts=[0] * config.depth)
    _synchronize(device)
    start = time.perf_counter()
    session = SpeculativeSession(model, drafter, config, generator, capacity=prompt_ids.shape[0] + max_new_tokens)
    tokens, done = _finish([session.prefill(prompt_ids)], eos_token_ids, max_new_tokens)
    while not done:
        new_tokens, acceptance = session.step()
        _record(result, len(acceptance.path), acceptance.tried_next_depth)
        before = len(tokens)
        tokens, done = _finish(tokens + new_tokens, eos_token_ids, max_new_tokens)
        result.committed_by_passes += len(tokens) - before
    _synchronize(device)
    result.tokens = tokens
    result.seconds = time.perf_counter() - start
    logger.debug("speculative: %d tokens in %d passes", len(tokens), result.target_passes)
    return result


def _record(result: GenerationResult, accepted: int, tried_next_depth: bool) -> None:
    """Per-round statistics: acceptance length and, per depth, attempts and acceptances."""
    result.target_passes += 1
    result.accepted.append(accepted)
    for depth in range(accepted):
        result.depth_attempts[depth] += 1
        result.depth_accepts[depth] += 1
    if tried_next_depth and accepted < len(result.depth_attempts):
        result.depth_attempts[accepted] += 1
