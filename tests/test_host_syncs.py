"""Host synchronisations in the training step, counted on the CPU so that the first GPU run is not the
first look: with loss-less rows kept (what the trainer does off CPU), a whole optimizer step of each
stage and of EAGLE-2 may read back to the host once, the metrics, and nothing else."""
from __future__ import annotations

import traceback
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from beagle import distributed, trainer
from beagle.data import Loader
from beagle.eagle2 import eagle2_loss
from beagle.stages import stage1_loss, stage2_loss
from beagle.train_config import TrainConfig
from tests.tiny_store import build_tiny_store

# aten ops that make the host wait for the device: reading a value (item, bool(), int()), or output
# shapes that depend on values (nonzero, boolean indexing, bincount, unique, masked_select).
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default",
            "aten.nonzero.default", "aten.masked_select.default", "aten.bincount.default", "aten.unique_dim.default",
            "aten._unique2.default", "aten.repeat_interleave.Tensor"}


def _in_optimizer() -> bool:
    return any("/torch/optim/" in frame.filename for frame in traceback.extract_stack(limit=8))


class SyncCounter(TorchDispatchMode):
    """Records every aten op that would synchronise a CUDA stream, with boolean-mask indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        boolean_index = name.startswith(("aten.index.Tensor", "aten.index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ())
        if name in SYNC_OPS or boolean_index:
            if not _in_optimizer():  # AdamW's step counters live on the host by design: no device wait
                self.syncs.append(f"{name} at {''.join(traceback.format_stack(limit=8))}")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    """Counts the Python-level reads back to the host (tolist, numpy, item) that the dispatcher cannot see."""
    reads: list[str] = []
    for name in ("tolist", "numpy", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if not _in_optimizer():  # AdamW's step counters live on the host by design: no device wait
                reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return build_tiny_store(tmp_path_factory.mktemp("syncs") / "store", num_samples=8)


@pytest.mark.parametrize("drafter, stage", [("beagle", 1), ("beagle", 2), ("eagle2", 1)])
def test_a_training_step_reads_back_to_the_host_once(store, tmp_path, host_reads, drafter, stage):
    config = TrainConfig(drafter=drafter, batch_tokens=256, lr=1e-3, warmup_steps=2, window_size=3,
                         simulation_steps=2, vocab_chunk=64, device="cpu", seed=0)
    loss_fn = {("beagle", 1): stage1_loss, ("beagle", 2): stage2_loss, ("eagle2", 1): eagle2_loss}[drafter, stage]
    with distributed.session("cpu") as ctx:
        run = trainer._start_run([store], tmp_path / "run", config, resume=False, cache_dir=None, ctx=ctx,
                                 verify_store=False)
        run.settings = replace(run.settings, compact_rows=False)  # as on an accelerator
        _, batch, wait = next(iter(Loader(run.data, run.plans[0], limit=config.sequence_limit)))
        run_loss = distributed.loss_runner(run.model, ctx)
        host_reads.clear()
        with SyncCounter() as counter:
            metrics = trainer._optimizer_step(run, run_loss, loss_fn, batch, wait, stage=stage, epoch=0)
    assert counter.syncs == [], "\n".join(counter.syncs)
    assert host_reads == ["tolist"], host_reads  # step_stats: loss terms, counts, tokens and grad norm at once
    assert metrics["loss"] > 0 and metrics["grad_norm"] > 0 and sum(metrics["rows"]) > 0


@pytest.mark.parametrize("loss_fn", [stage1_loss, stage2_loss, eagle2_loss])
def test_keeping_or_dropping_loss_less_rows_gives_the_same_loss(store, tmp_path, loss_fn):
    config = TrainConfig(drafter="eagle2" if loss_fn is eagle2_loss else "beagle", batch_tokens=256, window_size=3,
                         simulation_steps=2, vocab_chunk=64, device="cpu", seed=0, noise_std=0.0)
    with distributed.session("cpu") as ctx:
        run = trainer._start_run([store], tmp_path / "run", config, resume=False, cache_dir=None, ctx=ctx,
                                 verify_store=False)
        _, batch, _ = next(iter(Loader(run.data, run.plans[0], limit=config.sequence_limit)))
        results = [loss_fn(run.model, batch, 1, replace(run.settings, compact_rows=compact)).finish()
                   for compact in (True, False)]
    torch.testing.assert_close(results[0].loss, results[1].loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0].correct, results[1].correct) and torch.equal(results[0].count, results[1].count)


def test_the_tree_mask_is_built_on_the_device_without_reading_it_back(host_reads):
    from beagle.decoding.verify import tree_ancestors, tree_attention_mask
    from tests.decoding_helpers import tiny_target

    parents = torch.tensor([-1, 0, 0, 1, 3, 2, 5, 6, 0])
    expected = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents.tolist()):  # the definition: a node sees its parent's ancestors
        if parent >= 0:
            expected[node] |= expected[parent]
    host_reads.clear()
    depths = torch.tensor([0, 1, 1, 2, 3, 2, 3, 4, 1])
    with SyncCounter() as counter:
        ancestors = tree_ancestors(parents)
        mask = tree_attention_mask(parents, depths, 5, torch.float32, torch.device("cpu"), tiny_target())
    assert counter.syncs == [] and host_reads == []
    assert torch.equal(ancestors, expected)
    assert torch.equal(mask[0, 0, :, 5:] == 0, expected) and bool((mask[0, 0, :, :5] == 0).all())


def test_drafting_reads_the_device_as_often_at_depth_6_as_at_depth_2(host_reads):
    """Without a confidence gate no draft depth waits for the device: the reads per round do not grow."""
    from beagle.decoding import DraftConfig
    from beagle.decoding.generate import SpeculativeSession
    from beagle.decoding.tree import build_draft_tree
    from tests.decoding_helpers import random_drafter, tiny_target

    target = tiny_target()
    drafter = random_drafter(target)
    prompt = torch.tensor([3, 5, 7, 9])
    counts = {}
    for depth in (2, 6):
        config = DraftConfig(depth=depth, top_k=3, total_tokens=10)
        session = SpeculativeSession(target, drafter, config)
        session.prefill(prompt)
        host_reads.clear()
        with torch.no_grad(), SyncCounter() as counter:
            build_draft_tree(session.backend, session.token, len(prompt), config)
        counts[depth] = (len(counter.syncs), len(host_reads))
    assert counts[2] == counts[6], counts


@pytest.mark.parametrize("config, reads", [
    ("chain", ["tolist"]),               # the acceptance: target choices and drafted tokens at once
    ("tree", ["tolist", "tolist"]),      # the tree's shape (kept ids and parents at once), then the acceptance
])
def test_a_greedy_round_reads_the_device_once_for_a_chain_and_twice_for_a_tree(host_reads, config, reads):
    """A whole round (draft, verify, accept, commit to both caches): no value-dependent op, and these reads only."""
    from beagle.decoding import DraftConfig
    from beagle.decoding.generate import SpeculativeSession
    from tests.decoding_helpers import bigram_drafter, tiny_target

    target = tiny_target(context_scale=0.15)
    config = DraftConfig.chain(depth=4) if config == "chain" else DraftConfig(depth=3, top_k=3, total_tokens=8)
    session = SpeculativeSession(target, bigram_drafter(target), config, capacity=64)
    with torch.inference_mode():
        session.prefill(torch.tensor([3, 5, 7, 9]))
        for _ in range(3):
            host_reads.clear()
            with SyncCounter() as counter:
                session.step()
            assert counter.syncs == [], "\n".join(counter.syncs)
            assert host_reads == reads


def test_rounds_write_both_caches_in_place():
    """Rolled back by position, never reallocated: the buffers a session starts with are the ones it ends with."""
    from beagle.decoding import DraftConfig
    from beagle.decoding.generate import SpeculativeSession
    from tests.decoding_helpers import bigram_drafter, tiny_target

    target = tiny_target(context_scale=0.15)
    session = SpeculativeSession(target, bigram_drafter(target), DraftConfig(depth=3, top_k=3, total_tokens=8),
                                 capacity=64)
    with torch.inference_mode():
        session.prefill(torch.tensor([3, 5, 7, 9]))
        buffers = [layer.buffer._keys for layer in session.cache.layers] + [session.draft_cache.buffer._keys]
        pointers = [buffer.data_ptr() for buffer in buffers]
        accepted = sum(len(session.step()[1].path) for _ in range(8))
        buffers = [layer.buffer._keys for layer in session.cache.layers] + [session.draft_cache.buffer._keys]
    assert [buffer.data_ptr() for buffer in buffers] == pointers
    assert accepted > 0 and session.cache.get_seq_length() == len(session.draft_cache)
