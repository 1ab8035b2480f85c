"""Scale-out paths on one machine: training from a remote (fsspec) store through a local file cache."""
import json
from pathlib import Path

import fsspec
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from pipeline.commands.train import train as train_command
from beagle.train_config import TrainConfig
from beagle.trainer import train
from tests.tiny_store import build_tiny_store

SMALL = dict(batch_tokens=160, lr=3e-3, warmup_steps=2, window_size=3, simulation_steps=2, vocab_chunk=128,
             stage1_epochs=1, stage2_epochs=1, device="cpu", max_steps=3)


@pytest.fixture()
def remote_store(tmp_path):
    """A store published to fsspec's in-memory filesystem (a non-local implementation, like s3://)."""
    local = build_tiny_store(tmp_path / "local", num_samples=8)
    fs = fsspec.filesystem("memory")
    root = f"/published-{tmp_path.name}/store"
    fs.put(local + "/", root, recursive=True)
    yield local, f"memory://{root}"
    fs.rm(root, recursive=True)


def test_training_from_a_memory_store_with_a_cache_dir(remote_store, tmp_path):
    local, url = remote_store
    cache = tmp_path / "cache"
    result = CliRunner().invoke(train_command, [
        "--store", url, "--out", str(tmp_path / "remote"), "--cache-dir", str(cache), "--no-progress",
        "--config", _config(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "trained 3 steps" in result.output
    cached = [p for p in cache.rglob("*") if p.is_file()]
    assert cached, "the remote store's files should have been cached locally"
    train([local], tmp_path / "local-run", TrainConfig(**SMALL))
    a = load_file(str(tmp_path / "remote" / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "local-run" / "drafter" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # same data, same run
    run_config = json.loads((tmp_path / "remote" / "run_config.json").read_text())
    assert run_config["stores"] == [url]


def _config(tmp_path: Path) -> str:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


def test_device_map_auto_loads_the_target_and_gives_the_same_states(tmp_path):
    """`device_map="auto"` (layers spread over the actor's GPUs; here everything lands on the CPU) must
    store exactly what the plain load stores."""
    import numpy as np

    from pipeline.extract.forward import ForwardConfig, TargetForward
    from tests.tiny import build_target

    target = build_target(tmp_path / "target")
    sequences = [np.arange(3, 20), np.arange(5, 11)]
    plain = TargetForward(ForwardConfig(str(target), dtype="float32", device="cpu")).hidden_states(sequences)
    spread = TargetForward(ForwardConfig(str(target), dtype="float32", device_map="auto")).hidden_states(sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain, spread))


def test_ray_flags_are_checked_before_anything_starts(tmp_path):
    store = str(tmp_path / "missing")
    bad = CliRunner().invoke(train_command, ["--store", store, "--out", str(tmp_path / "r"), "--address", "auto"])
    assert bad.exit_code == 2 and "--num-workers" in bad.output
    bad = CliRunner().invoke(train_command, ["--store", store, "--out", str(tmp_path / "r"), "--num-workers", "0"])
    assert bad.exit_code == 2 and "--num-workers 0 must be >= 1" in bad.output
