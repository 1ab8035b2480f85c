"""bench/serve_analysis.py: what bench/serve.py makes of vLLM's per-request answers, checked on answers whose
truth is known: acceptance per group from histograms, the sampling check with a control it must reject, and the
crossover."""
from __future__ import annotations

import random

import pytest

from bench.serve_analysis import crossover, group_acceptance, same_distribution


def test_groups_sum_the_per_request_histograms():
    answers = [{"index": 0, "group": "code", "output_token_ids": [1] * 10, "latency": 1.0,
                "spec": {"histogram": [2, 1, 3], "num_draft_tokens": 12}},
               {"index": 1, "group": "code", "output_token_ids": [1] * 6, "latency": 1.0,
                "spec": {"histogram": [1, 1, 0], "num_draft_tokens": 4}},
               {"index": 2, "group": "math", "output_token_ids": [1] * 4, "latency": 2.0,
                "spec": {"histogram": [0, 0, 2], "num_draft_tokens": 4}}]
    plain = [{"index": i, "group": g, "output_token_ids": [1] * 4, "latency": 1.0}
             for i, g in enumerate(["code", "code", "math"])]
    groups = group_acceptance(answers, plain)
    code = groups["code"]
    assert code["drafts"] == 8 and code["acceptance_length"] == pytest.approx(1 + (1 + 6 + 1) / 8)
    assert code["per_position_acceptance"] == pytest.approx([5 / 8, 3 / 8])  # accepted >= 1, >= 2 drafts
    assert code["spec_tokens_per_second"] == 8.0 and code["tokens_per_second_ratio"] == pytest.approx(2.0)
    assert groups["math"]["acceptance_length"] == 3.0 and groups["math"]["tokens_per_second_ratio"] == 0.5


def _samples(probabilities: list[float], prompts: int, samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tokens = list(range(len(probabilities)))
    return [{"index": p, "output_token_ids": rng.choices(tokens, probabilities, k=4)}
            for p in range(prompts) for _ in range(samples)]


def test_the_sampling_check_keeps_equal_distributions_and_rejects_different_ones():
    same = [0.5, 0.3, 0.15, 0.05]
    kept = [same_distribution(_samples(same, 5, 60, seed), _samples(same, 5, 60, seed + 100))["p_value"]
            for seed in range(20)]
    assert sum(p < 0.01 for p in kept) <= 1 and sum(kept) / len(kept) > 0.3  # about uniform under the null
    sharper = [0.7, 0.2, 0.08, 0.02]  # what a lower temperature does to the same logits
    control = same_distribution(_samples(same, 5, 60, 1), _samples(sharper, 5, 60, 2))
    assert control["p_value"] < 1e-6 and control["dof"] > 0 and control["tables"] == 20


def test_the_crossover_is_the_first_level_where_speculation_costs():
    rows = [{"concurrency": 16, "tokens_per_second_ratio": 0.7}, {"concurrency": 1, "tokens_per_second_ratio": 1.3},
            {"concurrency": 4, "tokens_per_second_ratio": 0.95}]
    assert crossover(rows) == 4 and crossover(rows[1:2]) is None
