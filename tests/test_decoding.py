"""Speculative decoding, greedy: equality with plain decoding, forced acceptance, EOS/length, caches."""
import pytest
import torch

from beagle.decoding import DraftConfig, SpeculativeSession, build_draft_tree, plain_generate, speculative_generate
from beagle.decoding.drafters import BeagleBackend
from beagle.decoding.verify import new_cache, run_target, verify_tree
from tests.decoding_helpers import bigram_drafter, random_drafter, tiny_target

PROMPTS = [[3, 5, 7, 9, 11], [1], [40, 2, 2, 2, 8, 13, 21, 34, 55, 1, 4, 9]]
SHAPES = {
    "chain": DraftConfig.chain(depth=4),
    "chain-no-concat": DraftConfig.chain(depth=3, concatenate=False),
    "tree-narrow": DraftConfig(depth=3, top_k=2, total_tokens=5),
    "tree-wide": DraftConfig(depth=5, top_k=8, total_tokens=40),
    "tree-no-concat": DraftConfig(depth=4, top_k=3, total_tokens=10, concatenate=False),
    "chain-confident": DraftConfig.chain(depth=4, min_confidence=0.1),
    "tree-confident": DraftConfig(depth=5, top_k=4, total_tokens=16, min_confidence=0.05),
}


def _drafter(kind, target):
    return random_drafter(target) if kind == "random" else bigram_drafter(target, agree=True)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind,context_scale", [("random", 1.0), ("bigram", 0.15)])
def test_speculative_greedy_equals_plain(shape, kind, context_scale):
    target = tiny_target(context_scale=context_scale)
    drafter = _drafter(kind, target)
    accepted = 0
    for prompt in PROMPTS:
        prompt_ids = torch.tensor(prompt)
        plain = plain_generate(target, prompt_ids, 30, eos_token_ids=set())
        spec = speculative_generate(target, drafter, prompt_ids, 30, set(), SHAPES[shape])
        assert spec.tokens == plain.tokens, f"prompt {prompt}"
        assert spec.committed_by_passes == len(spec.tokens) - 1
        accepted += sum(spec.accepted)
    if kind == "bigram":  # the test exercises acceptance, not only rejections
        assert accepted > 10


def _acceptance(drafter_agrees: bool, config: DraftConfig):
    target = tiny_target(context_scale=0.0)
    drafter = bigram_drafter(target, agree=drafter_agrees)
    prompt = torch.tensor([3, 5, 7])
    spec = speculative_generate(target, drafter, prompt, 25, set(), config)
    assert spec.tokens == plain_generate(target, prompt, 25, set()).tokens
    return spec


def test_target_always_accepts_a_matching_drafter():
    spec = _acceptance(True, DraftConfig.chain(depth=4))
    assert spec.accepted[:-1] == [4] * (len(spec.accepted) - 1)  # the last round may stop at the length limit
    assert spec.depth_accepts[:4] == spec.depth_attempts[:4]
    assert spec.target_passes == 5  # 1 token from the prefill, then 24 in rounds of 5


def test_target_never_accepts_a_contrary_drafter():
    for config in (DraftConfig.chain(depth=4), DraftConfig(depth=3, top_k=5, total_tokens=12)):
        spec = _acceptance(False, config)
        assert set(spec.accepted) == {0}
        assert spec.target_passes == 24


def test_target_sometimes_accepts():
    target = tiny_target(context_scale=0.15)
    drafter = bigram_drafter(target, agree=True)
    spec = speculative_generate(target, drafter, torch.tensor([3, 5, 7]), 60, set(), DraftConfig.chain(depth=4))
    assert 0 in spec.accepted and max(spec.accepted) >= 2
    assert 0 < spec.depth_accepts[0] < spec.depth_attempts[0]


@pytest.mark.parametrize("config", [DraftConfig.chain(depth=5), DraftConfig(depth=5, top_k=3, total_tokens=15)])
def test_eos_and_length_limit_inside_a_draft(config):
    target = tiny_target(context_scale=0.0, seed=3)
    drafter = bigram_drafter(target, agree=True)
    prompt = torch.tensor([3, 5, 7])
    free = plain_generate(target, prompt, 30, set()).tokens
    # An EOS that the first round accepts as its 3rd drafted token: everything after it must go.
    round_one = speculative_generate(target, drafter, prompt, 30, set(), config)
    assert round_one.accepted[0] >= 3
    eos = free[3]
    first = free.index(eos)
    spec = speculative_generate(target, drafter, prompt, 30, {eos}, config)
    assert spec.tokens == free[:first + 1] == plain_generate(target, prompt, 30, {eos}).tokens
    for limit in (1, 2, 4, 7):
        assert speculative_generate(target, drafter, prompt, limit, set(), config).tokens == free[:limit]


def test_caches_match_a_fresh_forward_after_rejections():
    target = tiny_target(context_scale=0.15)
    drafter = bigram_drafter(target, agree=True)
    prompt = torch.tensor([3, 5, 7, 9])
    session = SpeculativeSession(target, drafter, DraftConfig(depth=4, top_k=4, total_tokens=16))
    committed = [session.prefill(prompt)]
    with torch.inference_mode():
        rejections = 0
        for _ in range(6):
            tokens, acceptance = session.step()
            committed += tokens
            rejections += len(acceptance.path) < 4
        assert rejections > 0
        # Everything committed except the pending token has been run through the target.
        sequence = torch.cat([prompt, torch.tensor(committed[:-1])])
        fresh = new_cache(target)
        output = run_target(target, fresh, sequence)
        for kept, reference in zip(session.cache.layers, fresh.layers):
            torch.testing.assert_close(kept.keys, reference.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(kept.values, reference.values, atol=1e-5, rtol=1e-4)
        keys, values = drafter.project_keys(output.hidden[None], torch.arange(len(sequence))[None])
        torch.testing.assert_close(session.draft_cache.keys, keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(session.draft_cache.values, values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_tree_verification_matches_each_path_run_alone(attn_implementation):
    """The tree mask and position ids give every node the logits of its own path run without a tree."""
    target = tiny_target(attn_implementation=attn_implementation)
    drafter = random_drafter(target)
    prompt = torch.tensor([4, 8, 15, 16, 23, 42])
    with torch.inference_mode():
        cache = new_cache(target)
        output = run_target(target, cache, prompt)
        backend = BeagleBackend(drafter, concatenate=True)
        backend.append(output.hidden, torch.arange(len(prompt)), prompt)
        tree = build_draft_tree(backend, 9, len(prompt), DraftConfig(depth=3, top_k=3, total_tokens=9))
        verified = verify_tree(target, cache, tree, len(prompt))
        for position in range(tree.size):
            path, node = [], position
            while node >= 0:
                path.append(int(tree.tokens[node]))
                node = int(tree.parents[node])
            alone = target(torch.cat([prompt, torch.tensor(path[::-1])])[None]).logits[0, -1]
            torch.testing.assert_close(verified.logits[position], alone, atol=1e-4, rtol=1e-4)


def test_tree_shape_follows_the_knobs():
    target = tiny_target()
    drafter = random_drafter(target)
    with torch.inference_mode():
        backend = BeagleBackend(drafter, concatenate=True)
        output = run_target(target, new_cache(target), torch.tensor([1, 2, 3]))
        backend.append(output.hidden, torch.arange(3), torch.tensor([1, 2, 3]))
        for config in (DraftConfig(depth=5, top_k=10, total_tokens=60), DraftConfig(depth=3, top_k=2, total_tokens=6),
                       DraftConfig.chain(depth=4)):
            tree = build_draft_tree(backend, 7, 3, config)
            assert tree.size == config.total_tokens + 1
            assert int(tree.depths.max()) <= config.depth
            for position in range(1, tree.size):
                parent = int(tree.parents[position])
                assert 0 <= parent < position and tree.depths[position] == tree.depths[parent] + 1
                assert len(tree.children[parent]) <= config.top_k
        assert tree.depths.tolist() == [0, 1, 2, 3, 4]  # the chain


def test_min_confidence_keeps_only_paths_the_drafter_is_sure_of():
    """Every kept node's path probability is >= the threshold, no confident node is left out, and a
    threshold of 1 drafts nothing: the round is then a plain step (τ = 1) with the same output."""
    target = tiny_target(context_scale=0.15)
    drafter = bigram_drafter(target)
    with torch.inference_mode():
        backend = BeagleBackend(drafter, concatenate=True)
        output = run_target(target, new_cache(target), torch.tensor([1, 2, 3]))
        backend.append(output.hidden, torch.arange(3), torch.tensor([1, 2, 3]))
        full = build_draft_tree(backend, 7, 3, DraftConfig(depth=4, top_k=4, total_tokens=60))
        path_prob = _path_probabilities(backend, full)
        for threshold in (0.05, 0.3, 0.9):
            tree = build_draft_tree(backend, 7, 3, DraftConfig(depth=4, top_k=4, total_tokens=60,
                                                               min_confidence=threshold))
            kept, eps = _paths(tree), 1e-4
            assert kept <= set(path_prob)  # the threshold only removes nodes
            assert all(path_prob[path] >= threshold - eps for path in kept)
            assert all(path in kept for path, p in path_prob.items() if p >= threshold + eps)
            assert len(kept) < len(path_prob)
        assert build_draft_tree(backend, 7, 3, DraftConfig.chain(depth=4, min_confidence=1.0)).size == 1
    prompt = torch.tensor([3, 5, 7, 9])
    spec = speculative_generate(target, drafter, prompt, 20, set(), DraftConfig.chain(depth=4, min_confidence=1.0))
    assert spec.tokens == plain_generate(target, prompt, 20, set()).tokens
    assert set(spec.accepted) == {0} and spec.target_passes == 19
    with pytest.raises(ValueError, match="temperature 0 only"):
        DraftConfig.chain(depth=3, temperature=1.0, min_confidence=0.2)


def _paths(tree) -> set[tuple[int, ...]]:
    """Each drafted node as the tuple of tokens from the root's child down to it."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = set()
    for position in range(1, tree.size):
        path, node = [], position
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        paths.add(tuple(reversed(path)))
    return paths


def _path_probabilities(backend, tree) -> dict[tuple[int, ...], float]:
    """The drafter's probability of each path of `tree`, recomputed by running the drafter down a chain."""
    probabilities = {}
    for path in _paths(tree):
        log_p, tokens = 0.0, [7]
        for token in path:
            log_q = _drafter_log_probs(backend, tokens)
            log_p += float(log_q[token])
            tokens.append(token)
        probabilities[path] = float(torch.tensor(log_p).exp())
    return probabilities


def _drafter_log_probs(backend, tokens: list[int]) -> torch.Tensor:
    """log q(. | true keys, drafted tokens) for the last of `tokens` (root first), drafted states as keys."""
    keys, values = backend.keys(), backend.values()
    past = keys.shape[-2]
    bank_keys = bank_values = None
    for step, token in enumerate(tokens):
        positions = torch.tensor([[past + step]])
        k = keys if bank_keys is None else torch.cat([keys, bank_keys], dim=-2)
        v = values if bank_values is None else torch.cat([values, bank_values], dim=-2)
        mask = torch.ones(1, 1, 1, k.shape[-2], dtype=torch.bool)
        hidden, bank = backend.step(torch.tensor([[token]]), positions, None, k, v, mask, need_bank=True)
        bank_keys = bank[0] if bank_keys is None else torch.cat([bank_keys, bank[0]], dim=-2)
        bank_values = bank[1] if bank_values is None else torch.cat([bank_values, bank[1]], dim=-2)
    return torch.log_softmax(backend.logits(hidden)[0, -1].float(), dim=-1)


def test_a_bfloat16_drafter_leaves_a_float32_target_output_unchanged():
    target = tiny_target(context_scale=0.15)
    drafter = bigram_drafter(target).to(torch.bfloat16)
    prompt = torch.tensor([3, 5, 7, 9])
    spec = speculative_generate(target, drafter, prompt, 30, set(), DraftConfig(depth=4, top_k=3, total_tokens=10))
    assert spec.tokens == plain_generate(target, prompt, 30, set()).tokens
    assert sum(spec.accepted) > 5


def test_a_reduced_draft_vocabulary_keeps_outputs_and_drafts_only_its_tokens(tmp_path):
    from beagle.decoding.draft_vocab import ReducedVocabDrafter, frequent_tokens
    from tests.tiny_store import build_tiny_store

    target = tiny_target(context_scale=0.15)
    url = build_tiny_store(tmp_path / "store", model=target, num_samples=6)
    tokens = frequent_tokens([url], 16, target.config.vocab_size, always={63})
    assert 63 in tokens.tolist() and 16 <= len(tokens) <= 17
    drafter = ReducedVocabDrafter(bigram_drafter(target), tokens)
    prompt = torch.tensor([3, 5, 7, 9])
    config = DraftConfig(depth=3, top_k=3, total_tokens=8)
    spec = speculative_generate(target, drafter, prompt, 30, set(), config)
    assert spec.tokens == plain_generate(target, prompt, 30, set()).tokens
    with torch.inference_mode():
        session = SpeculativeSession(target, drafter, config)
        session.prefill(prompt)
        tree = build_draft_tree(session.backend, session.token, len(prompt), config)
    assert set(tree.tokens[1:].tolist()) <= set(tokens.tolist())


def test_a_qwen2_target_decodes_identically():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    target = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in target.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.3)
    drafter = random_drafter(target)
    prompt = torch.tensor([3, 5, 7, 9])
    plain = plain_generate(target, prompt, 25, set()).tokens
    for config in (DraftConfig.chain(depth=3), DraftConfig(depth=3, top_k=4, total_tokens=12)):
        assert speculative_generate(target, drafter, prompt, 25, set(), config).tokens == plain


@pytest.mark.parametrize("reduced", [False, True])
def test_the_eagle2_baseline_drafter_decodes_identically(reduced):
    """The EAGLE-2 baseline (docs/method.md §7) drafts through the same tree and verification code."""
    from beagle.decoding.draft_vocab import ReducedVocabDrafter
    from beagle.eagle2 import Eagle2Drafter
    from beagle.model import DrafterConfig

    target = tiny_target(context_scale=0.15)
    torch.manual_seed(4)
    drafter = Eagle2Drafter(DrafterConfig.from_architecture(target.config.to_dict()),
                            target.get_input_embeddings().weight.detach(),
                            target.get_output_embeddings().weight.detach()).eval()
    with torch.no_grad():  # fc passes the token embedding through: the drafter then agrees with a near-bigram target
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :32].copy_(torch.eye(32))
        drafter.o_proj.weight.zero_()
        drafter.mlp.down_proj.weight.zero_()
    if reduced:
        drafter = ReducedVocabDrafter(drafter, torch.arange(0, 64, 2))
    accepted = 0
    for prompt in ([3, 5, 7, 9], [11]):
        prompt_ids = torch.tensor(prompt)
        plain = plain_generate(target, prompt_ids, 25, set()).tokens
        for config in (DraftConfig.chain(depth=3), DraftConfig(depth=4, top_k=3, total_tokens=10)):
            spec = speculative_generate(target, drafter, prompt_ids, 25, set(), config)
            assert spec.tokens == plain
            accepted += sum(spec.accepted)
    assert accepted > 10


def test_a_buffer_outgrown_keeps_its_scratch_rows():
    """A draft tree writes its keys past the committed length and attends to them at the next step; when that
    write outgrows the buffer, the reallocation must carry those scratch rows too (a bf16 tree once attended to
    uninitialised memory here and drafted NaN)."""
    from beagle.decoding.kv_cache import KeyValueBuffer

    buffer = KeyValueBuffer(capacity=4)
    rows = torch.arange(1, 7, dtype=torch.float32).view(1, 1, 6, 1)          # [B, H_kv, 6, hd]
    buffer.append(rows[..., :2, :], rows[..., :2, :])                          # committed: rows 0, 1
    buffer.write(2, rows[..., 2:4, :], rows[..., 2:4, :])                      # scratch: rows 2, 3 (capacity 4)
    buffer.write(4, rows[..., 4:, :], rows[..., 4:, :])                        # outgrows: reallocated
    keys, values = buffer.view(4)
    assert torch.equal(keys, rows) and torch.equal(values, rows) and buffer.length == 2
