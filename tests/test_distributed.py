"""Data-parallel training: 2 gloo ranks under torchrun (and Ray Train) end where one process ends.

Tolerance: fp32 on CPU; DDP sums per-rank gradients in a different order than one process does, so
weights agree to atol 1e-5 (observed differences are ~1e-7), not bit for bit.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from beagle.data import Loader, StoreSet, plan_epoch
from beagle.distributed import DistContext, shard_bounds
from beagle.train_config import TrainConfig
from beagle.trainer import train
from tests.tiny_store import build_tiny_store

ROOT = Path(__file__).parent.parent
# 1 stage-1 epoch + 1 stage-2 epoch over 10 samples of 12-40 tokens: 3 + 3 batches of up to 160 tokens.
# min_batch_rows=2: the plan of two ranks (each needs a row of every batch) and of one process is the same
SMALL = dict(batch_tokens=160, lr=3e-3, warmup_steps=2, window_size=3, simulation_steps=2, vocab_chunk=128,
             stage1_epochs=1, stage2_epochs=1, device="cpu", checkpoint_every=100, min_batch_rows=2)
STEPS = 4  # two epochs of two batches: the 10 samples packed at 160 tokens, at least 2 per batch


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_tiny_store(tmp_path_factory.mktemp("store") / "s", num_samples=10)


def test_shard_bounds_split_rows_contiguously_and_completely():
    for rows in range(0, 9):
        for world in (1, 2, 3, 4):
            bounds = [shard_bounds(rows, r, world) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_rank_micro_batches_reassemble_the_global_batch(store):
    data = StoreSet([store])
    plan = plan_epoch(data.lengths, batch_tokens=160, limit=160, seed=0, epoch=0)
    whole = [b for _, b, _ in Loader(data, plan, limit=160)]
    parts = [[b for _, b, _ in Loader(data, plan, limit=160, shard=(r, 2))] for r in range(2)]
    for index, batch in enumerate(whole):
        halves = [parts[0][index], parts[1][index]]
        assert [h.hidden.shape[1] for h in halves] == [batch.hidden.shape[1]] * 2  # padded to the global length
        assert torch.equal(torch.cat([h.input_ids for h in halves]), batch.input_ids)
        assert torch.equal(torch.cat([h.hidden for h in halves]), batch.hidden)
        assert sum(h.tokens for h in halves) == batch.tokens
        noise = [h.noise(torch.Generator().manual_seed(5)) for h in halves]
        assert torch.equal(torch.cat(noise), batch.noise(torch.Generator().manual_seed(5)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "drafter" / "model.safetensors"))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(single: Path, multi: Path) -> None:
    """Two ranks sum their halves where one process sums the whole batch: fp32 sums in another order differ in
    the 7th digit. Adam divides each update by the gradient's own scale, so where a gradient is near zero that
    can flip an update's sign: after 4 steps a few elements (~0.2% on this CPU) differ by up to a third of a
    step (1e-3 at lr 3e-3), the rest by ~1e-5 on average. Wrong rows, noise or averaging move most elements by
    a step's worth, so the test bounds the mean difference and the share of elements that differ."""
    a, b = _weights(single), _weights(multi)
    assert a.keys() == b.keys()
    for name in a:
        difference = (a[name] - b[name]).abs()
        assert difference.mean() < 5e-5 and (difference > 3e-4).float().mean() < 0.01, \
            (name, float(difference.mean()), float((difference > 3e-4).float().mean()))
    ma, mb = _metrics(single), _metrics(multi)
    assert len(ma) == len(mb) == STEPS  # only rank 0 logged
    assert [m["stage"] for m in mb] == [1, 1, 2, 2]
    for x, y in zip(ma, mb):
        assert x["tokens"] == y["tokens"] and x["rows"] == y["rows"]
        # the logged loss sums every row's terms, per rank then across ranks: agreement to ~6 digits of its value
        assert abs(x["loss"] - y["loss"]) < 2e-5 * max(1.0, abs(x["loss"])), (x["loss"], y["loss"])
        assert abs(x["grad_norm"] - y["grad_norm"]) < 1e-3 * x["grad_norm"]
    # training moved the weights: a run that did nothing could not pass
    assert any(not torch.allclose(a[n], torch.zeros_like(a[n])) for n in a)


@pytest.fixture(scope="module")
def single_run(store, tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    result = train([store], run, TrainConfig(**SMALL))
    assert result.steps == STEPS
    return run


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_match_one_process(store, single_run, tmp_path):
    config = tmp_path / "train.json"
    config.write_text(json.dumps(SMALL))
    run = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), "-m", "pipeline.commands.train", "--store", store, "--out", str(run),
         "--config", str(config), "--no-progress",
         # each rank's budget: 2 ranks x 80 = the one-process run's 160-token batches, samples up to 160
         "--rank-batch-tokens", "80", "--max-length", "160"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(f"trained {STEPS} steps") == 2  # both ranks finished the same number of steps
    _assert_same_run(single_run, run)
    assert len(list((run / "checkpoints").iterdir())) == 1  # rank 0 alone saved, once at the end


@pytest.mark.slow
def test_ray_train_two_workers_match_one_process(store, single_run, tmp_path):
    import ray

    from pipeline.train_launch import launch

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
    try:
        final = launch([store], tmp_path / "ray", TrainConfig(**SMALL), num_workers=2)
    finally:
        ray.shutdown()
    assert final["steps"] == STEPS and np.isfinite(final["loss"])
    _assert_same_run(single_run, tmp_path / "ray")


def test_ddp_wrapper_does_not_rebroadcast_the_frozen_head(tmp_path):
    """The frozen embedding and LM head are buffers; DDP must not re-send them at every forward."""
    import torch.distributed as dist

    from beagle.distributed import DistContext, loss_runner
    from beagle.model import BeagleDrafter, DrafterConfig

    config = DrafterConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           intermediate_size=32, vocab_size=20)
    model = BeagleDrafter(config, torch.randn(20, 16), torch.randn(20, 16))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        runner = loss_runner(model, DistContext(rank=0, world_size=2))
        assert isinstance(runner, torch.nn.parallel.DistributedDataParallel)
        assert runner.broadcast_buffers is False
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 8])
def test_every_rank_gets_rows_of_every_batch(world):
    """--batch-tokens is the global batch: with many ranks and a small budget, a batch of fewer rows than
    ranks would hand some ranks nothing. Every planned batch has at least one row per rank, and every
    sample is planned exactly once."""
    from beagle.distributed import shard_bounds

    lengths = np.random.default_rng(0).integers(5, 300, size=601)
    plan = plan_epoch(lengths, batch_tokens=300, limit=256, seed=1, epoch=0, min_rows=world)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        slices = [shard_bounds(len(batch), rank, world) for rank in range(world)]
        assert all(hi > lo for lo, hi in slices), (len(batch), slices)
    one_rank = plan_epoch(lengths, batch_tokens=300, limit=256, seed=1, epoch=0)
    assert min(len(b) for b in one_rank) < world <= min(len(b) for b in plan)  # the guard did something


def test_rank_batch_tokens_scale_the_global_batch_with_the_ranks():
    config = TrainConfig(rank_batch_tokens=512)
    assert config.for_world_size(1).batch_tokens == 512
    eight = config.for_world_size(8)
    assert (eight.batch_tokens, eight.max_length, eight.sequence_limit) == (4096, 512, 512)
    assert TrainConfig(rank_batch_tokens=512, max_length=300).for_world_size(4).max_length == 300
    assert TrainConfig(batch_tokens=1000).for_world_size(8).batch_tokens == 1000  # the global batch, as given
    from click.testing import CliRunner
    from pipeline.commands.train import train as train_command
    result = CliRunner().invoke(train_command, ["--store", "s", "--out", "o", "--batch-tokens", "4096",
                                                "--rank-batch-tokens", "512"])
    assert result.exit_code != 0 and "--batch-tokens and --rank-batch-tokens both given" in result.output


def test_each_rank_gets_its_own_gpu_and_an_explicit_one_is_refused_under_torchrun():
    """Checked without a GPU: torch.device objects name devices without touching them."""
    from beagle.distributed import rank_device

    torchrun = DistContext(rank=1, world_size=4, local_rank=1)
    assert rank_device(torch.device("cuda"), torchrun) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu"), torchrun) == torch.device("cpu")
    with pytest.raises(ValueError, match="would put all 4 ranks on GPU 2; pass --device cuda"):
        rank_device(torch.device("cuda", 2), torchrun)
    ray_train = DistContext(rank=1, world_size=4, local_rank=1, launcher="ray")
    assert rank_device(torch.device("cuda", 3), ray_train) == torch.device("cuda", 3)  # Ray's assignment, kept
    assert rank_device(torch.device("cuda", 2), DistContext()) == torch.device("cuda", 2)  # one process: as asked
