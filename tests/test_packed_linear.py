"""Packed bf16 linear layers for CPU decoding (beagle/decoding/packed_linear.py): same numbers, same drafts.

The packing itself needs a CPU that multiplies bf16 natively (AMX or AVX512-BF16); on one without, these
tests check that nothing is packed and decoding is untouched."""
import pytest
import torch
from torch import nn

from beagle.decoding import DraftConfig, SpeculativeSession, build_draft_tree, plain_generate, speculative_generate
from beagle.decoding.draft_vocab import ReducedVocabDrafter, select_draft_vocabulary
from beagle.decoding.packed_linear import PackedLinear, pack_for_decoding, packing_works
from tests.decoding_helpers import bigram_drafter, tiny_target

needs_packing = pytest.mark.skipif(not packing_works(), reason="this CPU does not multiply bf16 natively")


def _draft(drafter, target, prompt, config):
    with torch.inference_mode():
        session = SpeculativeSession(target, drafter, config)
        session.prefill(prompt)
        return build_draft_tree(session.backend, session.token, len(prompt), config)


def test_float32_layers_are_never_packed():
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert pack_for_decoding(module) == 0
    assert all(type(layer) is not PackedLinear for layer in module)


@needs_packing
@pytest.mark.parametrize("shape", [(1, 64), (4, 64), (17, 64), (2, 3, 64)])
def test_a_packed_layer_computes_exactly_what_nn_linear_computes(shape):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x)
        packed = PackedLinear(linear)
        assert torch.equal(packed(x), expected)
    assert packed.weight is linear.weight  # reads of the weight's dtype and the state dict see the parameter
    assert "packed" not in packed.state_dict()


@needs_packing
def test_a_packed_drafter_drafts_the_same_tree_and_decodes_identically():
    target = tiny_target(context_scale=0.15).to(torch.bfloat16)
    prompt = torch.tensor([3, 5, 7, 9])
    config = DraftConfig(depth=4, top_k=3, total_tokens=10)
    plain_drafter = ReducedVocabDrafter(bigram_drafter(target).to(torch.bfloat16), torch.arange(0, 64))
    packed_drafter = ReducedVocabDrafter(bigram_drafter(target).to(torch.bfloat16), torch.arange(0, 64))
    assert pack_for_decoding(packed_drafter) >= 6  # q, k, v, o, the MLP's three and the draft head
    assert isinstance(packed_drafter.head, PackedLinear)
    plain_tree, packed_tree = _draft(plain_drafter, target, prompt, config), _draft(packed_drafter, target, prompt,
                                                                                     config)
    assert torch.equal(plain_tree.tokens, packed_tree.tokens) and torch.equal(plain_tree.parents, packed_tree.parents)
    spec = speculative_generate(target, packed_drafter, prompt, 30, set(), config)
    assert spec.tokens == speculative_generate(target, plain_drafter, prompt, 30, set(), config).tokens
    assert sum(spec.accepted) > 0


def test_select_draft_vocabulary_packs_a_bf16_drafter_where_the_cpu_allows_and_float32_never():
    target = tiny_target(context_scale=0.15)
    drafter, _ = select_draft_vocabulary(bigram_drafter(target), {"draft_vocab": list(range(32))}, None, [], {63})
    assert not any(isinstance(m, PackedLinear) for m in drafter.modules())
    prompt = torch.tensor([3, 5, 7, 9])
    assert speculative_generate(target, drafter, prompt, 20, set(), DraftConfig.chain(3)).tokens == \
        plain_generate(target, prompt, 20, set()).tokens
    bf16, _ = select_draft_vocabulary(bigram_drafter(target).to(torch.bfloat16), {"draft_vocab": list(range(32))},
                                      None, [], {63})
    assert any(isinstance(m, PackedLinear) for m in bf16.modules()) == packing_works()
