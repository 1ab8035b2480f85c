"""bf16 autocast training on CPU: the default follows the hardware, a bf16 run learns about as well as
fp32 with fp32 master weights, and its export drafts in fp32 (equal to plain decoding) and in bf16."""
import json

import pytest
import torch
from safetensors.torch import load_file

from beagle.decoding import DraftConfig, plain_generate, speculative_generate
from beagle.export import load_drafter
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
    fp32 = train([store], tmp_path / "fp32", TrainConfig(**FAST, bf16=False), draw_curves=False)
    bf16 = train([store], tmp_path / "bf16", TrainConfig(**FAST, bf16=True), draw_curves=False)
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
