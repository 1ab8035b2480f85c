"""`--dtype auto`: the target's dtype decided by the hardware that runs it (beagle/precision.py).

bf16 where it is multiplied natively (a GPU; a CPU with AMX or AVX512-BF16), fp32 on other CPUs, where torch
emulates bf16 and a target generates several times slower. The rule is checked against this machine's own
answer, so the test holds on any CI CPU and fails if `auto` is passed on unresolved or resolved the wrong way.
"""
from pathlib import Path

import pytest
import torch

from beagle.precision import AUTO_DTYPE, cpu_has_native_bf16, resolve_target_dtype
from pipeline.regenerate.generation import GenerateConfig
from pipeline.regenerate.job import RegenerateConfig, resolve_dtype

HERE_ON_CPU = "bfloat16" if cpu_has_native_bf16() else "float32"


@pytest.mark.parametrize("requested", ["bfloat16", "float16", "float32"])
def test_a_named_dtype_is_kept_on_any_hardware(requested):
    assert resolve_target_dtype(requested, on_gpu=False) == requested
    assert resolve_target_dtype(requested, on_gpu=True) == requested


def test_auto_is_bf16_on_a_gpu_and_this_cpus_rule_elsewhere():
    assert resolve_target_dtype(AUTO_DTYPE, on_gpu=True) == "bfloat16"
    assert resolve_target_dtype(AUTO_DTYPE, on_gpu=False) == HERE_ON_CPU


def _config(tmp_path: Path, **changes) -> RegenerateConfig:
    generate = GenerateConfig(model_path=str(tmp_path / "target"), **changes.pop("generate", {}))
    return RegenerateConfig(generate=generate, data=(str(tmp_path / "in.jsonl"),), out=str(tmp_path / "a.jsonl"),
                            **changes)


def test_regenerate_defaults_to_auto_and_resolves_it_before_the_identity(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = _config(tmp_path)
    assert config.generate.dtype == AUTO_DTYPE
    expected = "bfloat16" if torch.cuda.is_available() else HERE_ON_CPU
    assert resolve_dtype(config).generate.dtype == expected


def test_regenerate_auto_on_cpu_actors_and_on_a_joined_cluster(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    on_cpu = _config(tmp_path, generate={"device": "cpu"})
    assert resolve_dtype(on_cpu).generate.dtype == HERE_ON_CPU
    without_gpus = _config(tmp_path, num_gpus_per_worker=0.0)
    assert resolve_dtype(without_gpus).generate.dtype == HERE_ON_CPU
    # A joined cluster is taken to be GPU workers (what extraction clusters are); --dtype float32 for a CPU one.
    joined = _config(tmp_path, address="ray://head:10001")
    assert resolve_dtype(joined).generate.dtype == "bfloat16"
    explicit = _config(tmp_path, generate={"dtype": "float32"}, address="ray://head:10001")
    assert resolve_dtype(explicit).generate.dtype == "float32"


def test_a_generator_built_without_the_job_resolves_auto_for_its_device(tmp_path):
    assert GenerateConfig(model_path="m", device="cpu").target.dtype == HERE_ON_CPU
    assert GenerateConfig(model_path="m", device="cpu", dtype="float16").target.dtype == "float16"
