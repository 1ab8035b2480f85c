"""Speculative sampling follows the target's distribution exactly (chi-square tests, fixed seeds)."""
import itertools

import pytest
import torch

from beagle.decoding import DraftConfig, DraftTree, sample_accept, speculative_generate
from beagle.decoding.tree import _propose_children
from tests.decoding_helpers import bigram_drafter, tiny_target


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expected below 5 are pooled into one."""
    expected = probs.double().flatten() * counts.sum()
    counts = counts.double().flatten()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


def _first_committed(p: torch.Tensor, q: torch.Tensor, top_k: int, generator) -> tuple[bool, int]:
    """A root whose children are drawn from q without replacement (as the tree builder does), verified
    against p; returns whether a draft was accepted and the committed token."""
    tokens, _, _ = _propose_children(q.log()[None], torch.zeros(1), torch.zeros(1), top_k, True, generator)
    count = tokens.shape[1]
    tree = DraftTree(tokens=torch.cat([torch.tensor([0]), tokens[0]]), parents=torch.tensor([-1] + [0] * count),
                     depths=torch.tensor([0] + [1] * count), children=[list(range(1, count + 1))] + [[]] * count,
                     draft_probs={0: q})
    acceptance = sample_accept(tree, p.log()[None].expand(count + 1, -1), 1.0, generator)
    if acceptance.path:
        return True, int(tree.tokens[acceptance.path[0]])
    return False, acceptance.bonus_token


@pytest.mark.parametrize("top_k", [1, 3])
def test_recursive_rejection_sampling_keeps_the_target_distribution(top_k):
    generator = torch.Generator().manual_seed(top_k)
    p = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.07])
    q = torch.tensor([0.05, 0.1, 0.4, 0.2, 0.05, 0.2])  # a poor drafter: many drafts are rejected
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(5000):
        was_accepted, token = _first_committed(p, q, top_k, generator)
        accepted += was_accepted
        counts[token] += 1
    assert 500 < accepted < 4500
    assert chi_square_p_value(counts, p) > 1e-3
    assert chi_square_p_value(counts, q) < 1e-6  # the test can tell a wrong distribution apart


def _exact_joint(target, prompt: list[int], length: int, temperature: float) -> torch.Tensor:
    """P(t_1..t_length | prompt) of the target, by enumerating every continuation."""
    vocab = target.config.vocab_size
    joint = torch.zeros((vocab,) * length, dtype=torch.float64)
    with torch.inference_mode():
        for prefix in itertools.product(range(vocab), repeat=length - 1):
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -length:]  # [length, V]
            probs = torch.softmax(logits.double() / temperature, dim=-1)
            head = 1.0
            for step, token in enumerate(prefix):
                head *= float(probs[step, token])
            joint[prefix] = head * probs[-1]
    return joint


@pytest.mark.slow
def test_speculative_sampling_matches_the_target_over_several_tokens():
    """Tokens 2 and 3 come from draft trees (accepted at depth 1 and 2, or corrected): their joint law,
    marginalised over the first token, must be the target's."""
    target = tiny_target(vocab_size=8, context_scale=0.5, layers=1, hidden_size=16, seed=5)
    drafter = bigram_drafter(target, agree=True)
    prompt, temperature = [1, 2, 3], 0.8
    joint = _exact_joint(target, prompt, 3, temperature).sum(dim=0)  # [V, V] over (t_2, t_3)
    generator = torch.Generator().manual_seed(0)
    config = DraftConfig(depth=3, top_k=2, total_tokens=5, temperature=temperature)
    counts = torch.zeros(8, 8)
    accepted = 0
    for _ in range(2000):
        result = speculative_generate(target, drafter, torch.tensor(prompt), 3, set(), config, generator)
        counts[result.tokens[1], result.tokens[2]] += 1
        accepted += result.accepted[0]
    assert accepted > 500  # depth-1 and depth-2 drafts were accepted, not only corrected
    assert chi_square_p_value(counts, joint) > 1e-3
    independent = joint.sum(1)[:, None] * joint.sum(0)[None]  # the test sees the dependence between tokens
    assert chi_square_p_value(counts, independent) < 1e-3
