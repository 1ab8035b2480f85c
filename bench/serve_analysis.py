"""What bench/serve.py makes of vLLM's per-request answers: acceptance per group, the sampling check, the load curve.

Pure functions over the JSON bench/serve_vllm.py writes (no vLLM, no torch), so they are tested fast
(tests/test_serve_analysis.py) and the slow engine test only has to prove the wiring.

* `group_acceptance`: vLLM's per-request acceptance histograms (`per_request_spec_decode_metrics`) summed per
  group (MT-Bench's category, a code or math set): acceptance length, acceptance at each position with its
  count of drafts, and output tokens/s over the group's requests.
* `same_distribution`: under sampling, speculative decoding must leave the output distribution unchanged. Many
  samples of each prompt, plain and speculative, are compared token by token at the first output positions:
  for every (prompt, position) a two-sample chi-square over the tokens seen there (rare tokens pooled), the
  statistics and degrees of freedom summed, and one p-value. Samples of one prompt are independent draws, so
  the test is valid at each position; a control (plain at two temperatures) must be rejected by the same test.
* `crossover`: the lowest concurrency at which speculative output tokens/s fall below plain.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Iterable

MIN_EXPECTED = 5  # tokens seen fewer times (both sides together) at a position are pooled into one cell


def group_acceptance(spec_answers: list[dict], plain_answers: list[dict] | None = None) -> dict[str, dict]:
    """{group: drafts, acceptance_length, per_position_acceptance, per_position_drafts, tokens/s (spec, plain,
    ratio)} from answers carrying `spec` = {"histogram": [count of steps that accepted j drafts], ...}."""
    groups: dict[str, dict] = {}
    plain_by_group: dict[str, list[dict]] = defaultdict(list)
    for answer in plain_answers or []:
        plain_by_group[str(answer.get("group"))].append(answer)
    by: dict[str, list[dict]] = defaultdict(list)
    for answer in spec_answers:
        by[str(answer.get("group"))].append(answer)
    for name, answers in by.items():
        histogram: list[int] = []
        for answer in answers:
            counts = (answer.get("spec") or {}).get("histogram") or []
            histogram = [a + b for a, b in zip(histogram + [0] * (len(counts) - len(histogram)),
                                               counts + [0] * (len(histogram) - len(counts)))]
        drafts = sum(histogram)
        accepted = sum(j * c for j, c in enumerate(histogram))
        per_position = [sum(histogram[j + 1:]) for j in range(max(len(histogram) - 1, 0))]  # accepted at j+1
        row = {"requests": len(answers), "drafts": drafts,
               "acceptance_length": 1 + accepted / drafts if drafts else None,
               "per_position_acceptance": [a / drafts if drafts else None for a in per_position],
               "per_position_drafts": [drafts] * len(per_position),
               "spec_tokens_per_second": _tokens_per_second(answers)}
        plain = plain_by_group.get(name)
        if plain:
            row["plain_tokens_per_second"] = _tokens_per_second(plain)
            row["tokens_per_second_ratio"] = (row["spec_tokens_per_second"] / row["plain_tokens_per_second"]
                                              if row["plain_tokens_per_second"] else None)
        groups[name] = row
    return groups


def _tokens_per_second(answers: list[dict]) -> float:
    seconds = sum(a.get("latency") or a.get("seconds") or 0.0 for a in answers)
    return sum(len(a["output_token_ids"]) for a in answers) / seconds if seconds > 0 else 0.0


def _chi_square_tail(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof), by Wilson-Hilferty (no scipy; within ~1e-3 for dof >= 3)."""
    if dof <= 0:
        return 1.0
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _tables(a: list[dict], b: list[dict], positions: Iterable[int]) -> Iterable[tuple[Counter, Counter]]:
    """(tokens of side a, tokens of side b) at each (prompt, position) both sides reached."""
    by_prompt_a, by_prompt_b = defaultdict(list), defaultdict(list)
    for answer in a:
        by_prompt_a[answer["index"]].append(answer["output_token_ids"])
    for answer in b:
        by_prompt_b[answer["index"]].append(answer["output_token_ids"])
    for prompt in sorted(set(by_prompt_a) & set(by_prompt_b)):
        for position in positions:
            left = Counter(ids[position] for ids in by_prompt_a[prompt] if len(ids) > position)
            right = Counter(ids[position] for ids in by_prompt_b[prompt] if len(ids) > position)
            if sum(left.values()) and sum(right.values()):
                yield left, right


def same_distribution(a: list[dict], b: list[dict], positions: Iterable[int] = (0, 1, 2, 3)) -> dict:
    """Two-sample chi-square of the token distributions of `a` and `b` (answers of bench/serve_vllm.py with
    several samples per prompt) at `positions`, summed over prompts and positions: statistic, dof, p_value."""
    statistic, dof, tables = 0.0, 0, 0
    for left, right in _tables(a, b, tuple(positions)):
        n_left, n_right = sum(left.values()), sum(right.values())
        cells: dict = {}
        for token in set(left) | set(right):
            key = token if left[token] + right[token] >= MIN_EXPECTED else "pooled"
            l, r = cells.get(key, (0, 0))
            cells[key] = (l + left[token], r + right[token])
        if len(cells) < 2:
            continue  # one token only on both sides: nothing to compare
        total = n_left + n_right
        for l, r in cells.values():
            column = l + r
            for observed, n in ((l, n_left), (r, n_right)):
                expected = column * n / total
                statistic += (observed - expected) ** 2 / expected
        dof += len(cells) - 1
        tables += 1
    return {"statistic": statistic, "dof": dof, "tables": tables, "p_value": _chi_square_tail(statistic, dof)}


def crossover(levels: list[dict]) -> int | None:
    """The lowest concurrency whose speculative ÷ plain tokens/s is below 1 (None: it pays at every level)."""
    for row in sorted(levels, key=lambda r: r["concurrency"]):
        ratio = row.get("tokens_per_second_ratio")
        if ratio is not None and ratio < 1:
            return row["concurrency"]
    return None


def plot_concurrency(lines: dict[str, list[dict]], path, title: str) -> None:
    """Speedup (speculative ÷ plain output tokens/s) against concurrency, one line per label (k, dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.4))
    for label, rows in lines.items():
        rows = sorted((r for r in rows if r.get("tokens_per_second_ratio") is not None), key=lambda r: r["concurrency"])
        axis.plot([r["concurrency"] for r in rows], [r["tokens_per_second_ratio"] for r in rows], marker="o",
                  label=label)
    axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent requests (max_num_seqs)")
    axis.set_ylabel("speculative ÷ plain tokens/s")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
