"""bf16 autocast training on CPU: the default follows the hardware, a bf16 run learns about as well as
fp32 with fp32 master weights, and its export drafts in fp32 (equal to plain decoding) and in bf16."""
import json

import pytest
import torch
from safetensors.torch import load_file

from beagle.decoding import DraftConfig, plain_generate, speculative_generate
from beagle.drafter_folder import load_drafter
from beagle.precision import cpu_has_native_bf16, training_dtype
from beagle.train_config import TrainConfig
from beagle.trainer import train
from tests.tiny_store import build_tiny_store, tiny_target

FAST = dict(batch_tokens=160, lr=3e-3, warmup_steps=3, window_size=3, simulation_steps=2, checkpoint_every=100,
            vocab_chunk=128, stage1_epochs=12, stage2_epochs=2, max_steps=36)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_tiny_store(tmp_path_factory.mktemp("store") / "a", num_samples=16)


def _losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_precision_default_follows_the_hardware_and_the_flag_decides():
    native = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert training_dtype(torch.device("cpu"), None) == native
    assert training_dtype(torch.device("cpu"), True) == torch.bfloat16
    assert training_dtype(torch.device("cpu"), False) == torch.float32


@pytest.mark.slow
def test_bf16_on_cpu_learns_like_fp32_and_its_export_drafts_in_both_dtypes(store, tmp_path):
    fp32 = train([store], tmp_path / "fp32", TrainConfig(**FAST, bf16=False))
    bf16 = train([store], tmp_path / "bf16", TrainConfig(**FAST, bf16=True))
    assert json.loads((tmp_path / "bf16" / "run_config.json").read_text())["precision"] == "bfloat16"
    assert json.loads((tmp_path / "fp32" / "run_config.json").read_text())["precision"] == "float32"
    assert bf16.steps == fp32.steps == FAST["max_steps"]
    losses = _losses(tmp_path / "bf16")
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses            # it learns
    assert losses != _losses(tmp_path / "fp32")                                  # bf16 really ran
    tail = lambda xs: sum(xs[-5:]) / 5                                           # noqa: E731
    assert abs(tail(losses) - tail(_losses(tmp_path / "fp32"))) < 0.1 * tail(_losses(tmp_path / "fp32"))

    weights = load_file(str(tmp_path / "bf16" / "drafter" / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}               # fp32 master weights exported

    target = tiny_target(0)                                                      # the store's target
    prompt = torch.tensor([5, 9, 14, 20])
    for dtype in (torch.float32, torch.bfloat16):
        model = target.to(dtype)
        drafter, _ = load_drafter(tmp_path / "bf16" / "drafter", embed_tokens=model.get_input_embeddings().weight,
                                  lm_head=model.get_output_embeddings().weight, dtype=dtype)
        with torch.no_grad():
            spec = speculative_generate(model, drafter, prompt, 24, set(), DraftConfig.chain(depth=3))
            plain = plain_generate(model, prompt, 24, set())
        assert len(spec.tokens) == 24 and spec.target_passes <= 24
        if dtype == torch.float32:                  # bf16 rounds one- and many-token passes differently
            assert spec.tokens == plain.tokens


@pytest.mark.parametrize("restricted", [False, True])
def test_bf16_keeps_one_bf16_copy_of_a_262k_head(restricted):
    """At a 262k vocabulary the frozen head dominates a rank's memory: a bf16 run keeps the embedding, the
    LM head and the loss head once each in bf16 (the loss head is the LM head itself unless a draft
    vocabulary is restricted), never an fp32 copy beside them."""
    from beagle.model import BeagleDrafter, DrafterConfig, loss_head, restrict_loss_vocabulary
    from beagle.precision import keep_frozen_head_in

    V, d = 262_144, 32
    config = DrafterConfig(hidden_size=d, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           intermediate_size=64, vocab_size=V)
    model = BeagleDrafter(config, torch.randn(V, d).bfloat16().float(), torch.randn(V, d).bfloat16().float())
    lm_head = model.lm_head.clone()
    if restricted:
        restrict_loss_vocabulary(model, torch.arange(0, V, 32))  # 8,192 rows
    keep_frozen_head_in(model, torch.bfloat16)
    frozen = {id(t): t for t in (model.embed_tokens, model.lm_head, loss_head(model))}.values()
    assert {t.dtype for t in frozen} == {torch.bfloat16}
    rows = 2 * V + (V // 32 if restricted else 0)
    assert sum(t.numel() * t.element_size() for t in model.buffers()) == rows * d * 2
    assert torch.equal(model.lm_head.float(), lm_head)  # exact: the head came from bf16 values
    assert not [name for name, _ in model.named_buffers() if name not in ("embed_tokens", "lm_head", "loss_head")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.forward_hidden(torch.tensor([[1, 2, 3]]), torch.arange(3)[None],
                                      *model.project_keys(torch.randn(1, 3, d), torch.arange(3)[None]),
                                      torch.ones(1, 1, 3, 3, dtype=torch.bool).tril())
    assert hidden.shape == (1, 3, d) and torch.isfinite(hidden).all()
