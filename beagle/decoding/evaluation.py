"""Run plain and speculative decoding over the same prompts in one process and summarise (docs/method.md §6).

Measures:
* τ (acceptance length): tokens committed per target verification pass, bonus included; the first token
  of each answer comes from the prefill and is counted by neither side. τ = 1 + Σ_j Π_{i≤j} α_i when no
  answer is cut by EOS or the length limit.
* α_j (per-depth acceptance): of the rounds that tried a draft at depth j (the depth j-1 token was
  accepted and had children), the fraction where the target accepted one.
* tokens/s of each side over all answers (prefill included), and their ratio, the speedup.
Each is reported over all prompts and per group (`PromptItem.group`: MT-Bench's category, a code or a math
set), and every α comes with its count of attempts: a rate over fewer than FEW_ATTEMPTS is marked as rough.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from beagle.decoding.generate import GenerationResult, plain_generate, speculative_generate
from beagle.decoding.tree import DraftConfig
from beagle.host_memory import peak_rss_mib
from beagle.prompts import TEXT_ROLE, PromptItem, render

logger = logging.getLogger(__name__)

FEW_ATTEMPTS = 20        # an α over fewer attempts is shown, marked, but is no rate to compare drafters by
UNGROUPED = "(no group)"  # the group of a prompt whose record lacks the grouping field


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    passes: int = 0
    committed: int = 0
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)

    def add(self, result: GenerationResult) -> None:
        self.tokens += len(result.tokens)
        self.seconds += result.seconds
        self.passes += result.target_passes
        self.committed += result.committed_by_passes
        if result.depth_attempts:
            if not self.depth_attempts:
                self.depth_attempts = [0] * len(result.depth_attempts)
                self.depth_accepts = [0] * len(result.depth_accepts)
            for depth, (tried, accepted) in enumerate(zip(result.depth_attempts, result.depth_accepts)):
                self.depth_attempts[depth] += tried
                self.depth_accepts[depth] += accepted

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def acceptance_length(speculative: Totals) -> float:
    """τ: tokens committed per target verification pass, bonus included."""
    return speculative.committed / speculative.passes if speculative.passes else 0.0


def per_depth_acceptance(speculative: Totals) -> list[float | None]:
    return [accepted / tried if tried else None
            for tried, accepted in zip(speculative.depth_attempts, speculative.depth_accepts)]


def speedup(baseline: Totals, speculative: Totals) -> float:
    base = baseline.tokens_per_second
    return speculative.tokens_per_second / base if base > 0 else 0.0


def rates_json(baseline: Totals, speculative: Totals) -> dict:
    """τ, α per depth with its attempts (and which rates are over few of them), tokens/s and the speedup."""
    attempts = list(speculative.depth_attempts)
    return {"acceptance_length": acceptance_length(speculative),
            "per_depth_acceptance": per_depth_acceptance(speculative),
            "per_depth_attempts": attempts,
            "per_depth_few_attempts": [0 < tried < FEW_ATTEMPTS for tried in attempts],
            "target_passes": speculative.passes,
            "tokens_per_second": {"baseline": baseline.tokens_per_second,
                                  "speculative": speculative.tokens_per_second},
            "speedup": speedup(baseline, speculative)}


@dataclass
class GroupTotals:
    """Both sides' totals over the prompts of one group."""

    prompts: int = 0
    baseline: Totals = field(default_factory=Totals)
    speculative: Totals = field(default_factory=Totals)

    def to_json(self) -> dict:
        return {"prompts": self.prompts, **rates_json(self.baseline, self.speculative)}


@dataclass
class EvalSummary:
    """What `eval` prints and writes with `--json`."""

    baseline: Totals
    speculative: Totals
    mismatches: list[str]
    num_prompts: int
    max_new_tokens: int
    config: DraftConfig
    peak_memory_mb: dict[str, float]
    answers: list[dict] = field(default_factory=list)
    answers_compared: int = 0  # greedy answers compared token for token (every turn of every prompt)
    group_field: str | None = None                                  # what the prompts were grouped by
    groups: dict[str, GroupTotals] = field(default_factory=dict)    # in order of first appearance

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.speculative)

    @property
    def per_depth_acceptance(self) -> list[float | None]:
        return per_depth_acceptance(self.speculative)

    @property
    def speedup(self) -> float:
        return speedup(self.baseline, self.speculative)

    @property
    def grouped(self) -> bool:
        """Whether any prompt carried the grouping field (else the groups say nothing the total does not)."""
        return any(name != UNGROUPED for name in self.groups)

    def to_json(self) -> dict:
        return {
            **rates_json(self.baseline, self.speculative),
            "outputs_match": not self.mismatches,
            "mismatches": self.mismatches,
            "answers_compared": self.answers_compared,
            "num_prompts": self.num_prompts,
            "max_new_tokens": self.max_new_tokens,
            "tokens": {"baseline": self.baseline.tokens, "speculative": self.speculative.tokens},
            "target_passes": {"baseline": self.baseline.passes, "speculative": self.speculative.passes},
            "peak_memory_mb": self.peak_memory_mb,
            "draft": {"depth": self.config.depth, "top_k": self.config.top_k,
                      "total_tokens": self.config.total_tokens, "temperature": self.config.temperature,
                      "concatenate": self.config.concatenate},
            "few_attempts": FEW_ATTEMPTS,
            "by": ({"field": self.group_field, "groups": {name: group.to_json() for name, group in self.groups.items()}}
                   if self.grouped else None),
        }


def _answer(model, prompt_ids, max_new_tokens, eos_ids, config, seed, drafter=None) -> GenerationResult:
    generator = torch.Generator(device=prompt_ids.device).manual_seed(seed)
    if drafter is None:
        return plain_generate(model, prompt_ids, max_new_tokens, eos_ids, config.temperature, generator)
    return speculative_generate(model, drafter, prompt_ids, max_new_tokens, eos_ids, config, generator)


def _conversation(model, tokenizer, item: PromptItem, max_new_tokens, eos_ids, config, seed, device,
                  drafter=None) -> list[GenerationResult]:
    """Ask every turn of `item`, carrying this side's own answers into the next turn."""
    messages = list(item.history)
    results = []
    for turn, question in enumerate(item.turns):
        messages.append({"role": TEXT_ROLE if item.text else "user", "content": question})
        prompt_ids = torch.tensor(render(tokenizer, messages), device=device)
        result = _answer(model, prompt_ids, max_new_tokens, eos_ids, config, seed + turn, drafter)
        results.append(result)
        messages.append({"role": "assistant",
                         "content": tokenizer.decode(result.tokens, skip_special_tokens=True)})
    return results


def evaluate_prompts(model, drafter, tokenizer, items: list[PromptItem], config: DraftConfig,
                     max_new_tokens: int, eos_ids: set[int], seed: int = 0,
                     progress: Callable[[Iterable], Iterable] = lambda items: items,
                     keep_answers: bool = False, group_field: str | None = None) -> EvalSummary:
    """Answer every prompt twice, plain then speculative, and compare (greedy outputs must be identical).
    Totals are kept per `PromptItem.group` too (`group_field`: the record field the groups came from)."""
    device = next(model.parameters()).device
    # Warm-up (allocator, kernels, lazy init) so that neither side pays first-call costs in the timings.
    warm = PromptItem("warm-up", items[0].history, items[0].turns[:1], items[0].text)
    for side in (None, drafter):
        _conversation(model, tokenizer, warm, min(8, max_new_tokens), eos_ids, config, seed, device, side)

    baseline, speculative = Totals(), Totals()
    peaks = {"baseline": 0.0, "speculative": 0.0}
    mismatches: list[str] = []
    answers: list[dict] = []
    compared = 0
    groups: dict[str, GroupTotals] = {}
    for index, item in enumerate(progress(items)):
        group = groups.setdefault(UNGROUPED if item.group is None else item.group, GroupTotals())
        group.prompts += 1
        per_side = {}
        for name, side, totals, in_group in (("baseline", None, baseline, group.baseline),
                                             ("speculative", drafter, speculative, group.speculative)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            per_side[name] = _conversation(model, tokenizer, item, max_new_tokens, eos_ids, config,
                                           seed + 1000 * index, device, side)
            for result in per_side[name]:
                totals.add(result)
                in_group.add(result)
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_rss_mib()
            peaks[name] = max(peaks[name], peak)
        for turn, (plain, spec) in enumerate(zip(per_side["baseline"], per_side["speculative"])):
            compared += config.temperature == 0
            if config.temperature == 0 and plain.tokens != spec.tokens:
                first = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b),
                             min(len(plain.tokens), len(spec.tokens)))
                mismatches.append(f"prompt {item.prompt_id} turn {turn + 1}: outputs differ from token {first}")
                logger.warning(mismatches[-1])
            if keep_answers:
                answers.append({"prompt_id": item.prompt_id, "turn": turn + 1,
                                "baseline": tokenizer.decode(plain.tokens, skip_special_tokens=True),
                                "speculative": tokenizer.decode(spec.tokens, skip_special_tokens=True)})
    if device.type != "cuda":
        peaks = {"process_peak_rss": peak_rss_mib()}
    return EvalSummary(baseline=baseline, speculative=speculative, mismatches=mismatches, num_prompts=len(items),
                       max_new_tokens=max_new_tokens, config=config, peak_memory_mb=peaks, answers=answers,
                       answers_compared=compared, group_field=group_field, groups=groups)
