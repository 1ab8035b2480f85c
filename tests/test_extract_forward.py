"""The target forward and the shard actor, without Ray: right states, no padding leak, a readable shard."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.extract.actor import ShardExtractor
from beagle.layer_capture import normalize_layers
from pipeline.extract.forward import ForwardConfig, TargetForward, plan_batches, states_to_host
from pipeline.jobkit.target import target_fingerprint
from beagle.torch_store import open_store
from pipeline.store import begin_store, commit_manifest, committed_shards, compute_dataset_id, store_identity
from tests.tiny import build_target

LENGTHS = [5, 17, 9, 30, 3, 17]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target"), template="chatml")


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 320, size=n).astype(np.int32) for n in LENGTHS]


def test_batched_equals_one_at_a_time_and_the_lm_head_reads_layer_minus_one(target, sequences):
    forward = TargetForward(ForwardConfig(str(target), layers=(-1, 0, 1), dtype="float32", batch_tokens=64))
    batched = forward.hidden_states(sequences)
    assert len(plan_batches(LENGTHS, 64)) < len(LENGTHS)  # some batches really hold several padded rows
    with torch.no_grad():
        for sequence, states in zip(sequences, batched):
            assert states.shape == (3, len(sequence), 64) and states.dtype == torch.float32
            alone = forward.forward_batch([sequence])[0]
            # fp32: a different batch shape changes the matmul blocking, not the values beyond rounding.
            torch.testing.assert_close(states, alone, atol=1e-5, rtol=1e-5)
            full = forward.model(torch.as_tensor(sequence, dtype=torch.long)[None], output_hidden_states=True)
            torch.testing.assert_close(forward.model.lm_head(states[0]), full.logits[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(states[1], full.hidden_states[0][0])
            torch.testing.assert_close(states[2], full.hidden_states[1][0], atol=1e-6, rtol=1e-6)


class _CopyCounter(TorchDispatchMode):
    """Names the aten ops that move or allocate tensor data."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(word in name for word in ("copy", "stack", "cat", "clone", "contiguous", "empty")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_captured_states_reach_the_host_in_one_copy_per_layer():
    states = [torch.randn(2, 7, 8) for _ in range(3)]  # n_layers x [B, L, d]
    with _CopyCounter() as counter:
        host = states_to_host(states)
    assert host.shape == (2, 3, 7, 8) and torch.equal(host, torch.stack(states, dim=1))
    assert sorted(counter.ops) == ["aten.copy_.default"] * 3 + ["aten.empty.memory_format"]
    with _CopyCounter() as counter:
        single = states_to_host(states[:1])
    assert counter.ops == [] and single.data_ptr() == states[0].data_ptr()  # one layer on the CPU: a view


def test_plan_batches_respects_the_budget_and_covers_every_sample():
    lengths = [7, 1, 30, 30, 12, 5, 64, 2]
    plan = plan_batches(lengths, 40)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 40
    assert plan == plan_batches(list(lengths), 40)


def test_layers_are_checked_and_canonical():
    assert normalize_layers([-1, 0, -2], 2) == [-1, 0, 1]
    assert normalize_layers([2], 2) == [-1]  # hidden_states[n] is the state after the final norm
    with pytest.raises(ValueError, match="names the same layer twice"):
        normalize_layers([-1, 2], 2)
    with pytest.raises(ValueError, match="--layers 5: out of range"):
        normalize_layers([5], 2)


def test_model_directories_without_weights_fail_naming_them(tmp_path, target):
    with pytest.raises(ValueError, match="not a directory"):
        target_fingerprint(str(tmp_path / "missing"), "bfloat16")
    (tmp_path / "config.json").write_text((target / "config.json").read_text())
    with pytest.raises(ValueError, match=f"--model {tmp_path}: no weight files"):
        target_fingerprint(str(tmp_path), "bfloat16")
    fingerprint = target_fingerprint(str(target), "bfloat16")
    assert fingerprint["architecture"]["num_key_value_heads"] == 2 and fingerprint["architecture"]["head_dim"] == 16
    assert fingerprint == target_fingerprint(str(target), "bfloat16")


@pytest.mark.parametrize("layers", [(-1,), (-1, 0, 1)])  # several layers: padded rows are strided views
def test_shard_actor_works_without_ray_on_a_hand_built_shard(tmp_path, target, sequences, layers):
    url = str(tmp_path / "store")
    facts = {"target": target_fingerprint(str(target), "bfloat16"), "tokenizer": {}, "source": {"files": []},
             "capture": {"layers": list(layers), "dtype": "bfloat16", "max_length": 64}}
    dataset_id = compute_dataset_id(store_identity(**facts))
    assert begin_store(url, dataset_id) == "new"
    samples = [{"sample_id": f"s{i}", "input_ids": s, "loss_mask": np.arange(len(s)) % 2 == 1}
               for i, s in enumerate(sequences)]
    config = ForwardConfig(str(target), layers=layers, dtype="bfloat16", batch_tokens=64)
    actor = ShardExtractor(config, url)
    out = actor.extract(0, samples)
    assert out["shard_index"] == 0 and (tmp_path / "store" / "head.safetensors").exists()
    info = committed_shards(url)[0]
    assert info == out["info"]
    assert info["samples"] == len(sequences) and info["tokens"] == sum(LENGTHS)
    commit_manifest(url, dataset_id=dataset_id, **facts, shards=[info], rejected={})
    store = open_store(url)
    expected = TargetForward(config).hidden_states(sequences)
    for i, sample in enumerate(samples):
        item = store[i]
        assert item["sample_id"] == sample["sample_id"]
        assert item["input_ids"].tolist() == sample["input_ids"].tolist()
        assert item["loss_mask"].tolist() == sample["loss_mask"].tolist()
        assert torch.equal(item["hidden_states"].view(torch.int16), expected[i].view(torch.int16))  # bit-exact
    head = store.load_head()
    assert torch.equal(head["lm_head"], actor.forward.model.lm_head.weight.detach())


def test_a_tied_lm_head_is_stored_as_its_own_tensor(tmp_path):
    from safetensors.torch import load_file

    from pipeline.extract.state_encoding import write_head
    forward = TargetForward(ForwardConfig(str(build_target(tmp_path / "tied", tied=True)), dtype="float32"))
    head = forward.head()
    assert head["lm_head"].data_ptr() != head["embed_tokens"].data_ptr()
    (tmp_path / "store").mkdir()
    write_head(str(tmp_path / "store"), **head)
    loaded = load_file(str(tmp_path / "store" / "head.safetensors"))
    assert torch.equal(loaded["lm_head"], loaded["embed_tokens"])


def test_the_default_batch_follows_the_device_kind_and_an_explicit_one_wins():
    """A CPU forwards faster in small batches (their activations stay in the caches), a GPU in large ones."""
    from pipeline.extract.pipeline import DEFAULT_BATCH_TOKENS, ExtractConfig, default_batch_tokens

    config = ExtractConfig(model_path="m", data=("d.jsonl",), out="o")
    assert default_batch_tokens(config, "CPU") == DEFAULT_BATCH_TOKENS["CPU"] < DEFAULT_BATCH_TOKENS["GPU"]
    assert default_batch_tokens(config, "GPU") == DEFAULT_BATCH_TOKENS["GPU"]
    assert default_batch_tokens(ExtractConfig(model_path="m", data=("d.jsonl",), out="o", batch_tokens=512), "GPU") == 512


def test_the_default_capture_is_eagle3_s_aux_layers_and_the_head_s_state():
    """vLLM's and SGLang's EAGLE-3 default aux layers (2, n // 2, n - 3) for real depths, three distinct
    layers for shallow ones, and -1 last: what `extract` stores without --layers."""
    from beagle.layer_capture import default_capture_layers, eagle3_aux_layers
    assert eagle3_aux_layers(30) == [2, 15, 27] and eagle3_aux_layers(80) == [2, 40, 77]
    assert eagle3_aux_layers(4) == [1, 2, 3] and eagle3_aux_layers(6) == [1, 3, 5]
    assert default_capture_layers(32) == [2, 16, 29, -1] and default_capture_layers(2) == [1, -1]
    for n in range(1, 40):
        assert normalize_layers(default_capture_layers(n), n) == default_capture_layers(n)


def test_layers_for_captures_what_the_named_forms_rows_need(tmp_path):
    """`extract --layers-for FORMS`: -1 alone for the forms keyed on the last state, EAGLE-3's aux layers too for
    the engine form (its row's `keys`), the default for all; with --layers it is refused."""
    from beagle.errors import SettingsError
    from beagle.layer_capture import default_capture_layers
    from pipeline.extract.pipeline import ExtractConfig, prepare
    from tests.tiny import build_target

    target = build_target(tmp_path / "target")
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n')

    def layers(**choice):
        return prepare(ExtractConfig(model_path=str(target), data=(str(data),), out=str(tmp_path / "s"),
                                     **choice)).layers

    n = 2  # tests/tiny.py's depth
    assert layers(layers_for=("beagle",)) == layers(layers_for=("eagle2", "beagle")) == [-1]
    assert layers(layers_for=("beagle-state",)) == layers() == default_capture_layers(n)
    with pytest.raises(SettingsError, match="--layers and --layers-for"):
        layers(layers=(-1,), layers_for=("beagle",))
    with pytest.raises(ValueError, match="--layers-for='nope' is not a drafter form"):
        layers(layers_for=("nope",))
