"""LayerCapture: the wanted layers' states by hooks, equal to `output_hidden_states`, on every family we claim."""
import pytest
import torch

from beagle.decoding.verify import new_cache, run_target
from beagle.layer_capture import LayerCapture, base_model
from tests.tiny_families import FAMILIES, family_model

LAYER_SETS = [(-1,), (0,), (1, -1), (0, 1, 2)]  # 2 = n: after the final norm, like -1


def _requested_all_states(model: torch.nn.Module) -> list[bool]:
    """Records, per forward of `model`, whether it was asked for every layer's states."""
    asked: list[bool] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: asked.append(bool(kwargs.get("output_hidden_states"))),
                                    with_kwargs=True)
    return asked


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hooked_layers_equal_output_hidden_states(family):
    torch.manual_seed(0)
    model = family_model(family, 96, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    ids = torch.randint(2, 96, (2, 9))
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True).hidden_states  # n+1 x [B, L, d]
        for layers in LAYER_SETS:
            with LayerCapture(model, layers) as capture:
                assert not capture.output_hidden_states, family
                outputs = model(input_ids=ids)
            got = capture.states(outputs)
            assert len(got) == len(layers)
            for layer, state in zip(layers, got):
                assert torch.equal(state, reference[layer]), (family, layer)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_run_target_keeps_only_the_wanted_layers_and_matches_all_states(family):
    """A prefill (last logits only) and a many-token step return the states output_hidden_states would, without
    asking the model for all of them."""
    torch.manual_seed(0)
    model = family_model(family, 96, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    ids = torch.randint(2, 96, (12,))
    with torch.no_grad():
        reference = model(input_ids=ids[None], output_hidden_states=True).hidden_states
        asked = _requested_all_states(model)
        cache = new_cache(model)
        prefill = run_target(model, cache, ids[:8], layers=(1, -1), last_logits_only=True)
        step = run_target(model, cache, ids[8:], torch.arange(8, 12), layers=(1, -1))
    assert asked == [False, False]
    assert prefill.logits.shape[0] == 1 and step.logits.shape[0] == 4
    expected = torch.cat([reference[1][0], reference[-1][0]], dim=-1)  # [12, 2d]
    torch.testing.assert_close(prefill.hidden, expected[:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.hidden, expected[8:], atol=1e-5, rtol=1e-5)


def test_a_model_whose_layer_list_is_ambiguous_falls_back_to_all_states():
    torch.manual_seed(0)
    model = family_model("llama", 96, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    base = base_model(model)
    base.shadow_layers = torch.nn.ModuleList(torch.nn.Identity() for _ in base.layers)  # two lists of n: ambiguous
    ids = torch.randint(2, 96, (1, 6))
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True).hidden_states
        with LayerCapture(model, (1, -1)) as capture:
            outputs = model(input_ids=ids, output_hidden_states=capture.output_hidden_states)
    assert capture.output_hidden_states
    assert all(torch.equal(a, b) for a, b in zip(capture.states(outputs), (reference[1], reference[-1])))
    # only the last layer: no layer list needed, hooks on the base model suffice
    assert not LayerCapture(model, (-1,)).output_hidden_states


def test_a_layer_out_of_range_is_refused():
    model = family_model("llama", 96, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="out of range for a model with 2 layers"):
        LayerCapture(model, (3,))
