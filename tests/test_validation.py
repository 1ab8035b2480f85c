"""Held-out validation (`--val-samples`, `--val-store`, `--eval-every`) and gradient accumulation
(`--grad-accum`) on tiny real stores: defaults train as before, accumulation gives the whole batch's
gradients, held-out samples never reach a training batch, records survive resume, bad flags are refused."""
import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from beagle import distributed, trainer
from beagle.data import StoreSet, collate
from beagle.offline_acceptance import batch_acceptance, store_acceptance
from beagle.registry import FORMS
from pipeline.commands.train import train as train_command
from beagle.train_config import TrainConfig
from beagle.trainer import train
from tests.tiny_store import build_tiny_store
from pipeline.commands.curves import draw_run_curves

ROOT = Path(__file__).parent.parent
FAST = dict(batch_tokens=160, lr=3e-3, warmup_steps=3, window_size=3, simulation_steps=2, checkpoint_every=4,
            vocab_chunk=128, stage1_epochs=1, stage2_epochs=1, device="cpu")
TIMING = ("tokens_per_s", "data_wait_fraction", "seconds")  # wall-clock fields: differ between equal runs


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_tiny_store(tmp_path_factory.mktemp("store") / "a", num_samples=16, layers=(1, -1))


@pytest.fixture(scope="module")
def other_store(tmp_path_factory):
    """Other samples of the same target: a validation store."""
    return build_tiny_store(tmp_path_factory.mktemp("store") / "b", num_samples=5, seed=7, layers=(1, -1))


def _lines(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> bytes:
    return (run / "drafter" / "model.safetensors").read_bytes()


def test_explicit_default_flags_and_a_validation_store_leave_training_bit_identical(store, other_store, tmp_path):
    """Defaults vs --grad-accum 1 --val-samples 0 --eval-every 3: the same drafter bytes. A run that validates
    on another store trains on the same samples: its steps and drafter are bit-identical too, so evaluating
    reads no random state, mode or gradient that training uses."""
    config = tmp_path / "fast.json"
    config.write_text(json.dumps(FAST))
    common = ["--store", store, "--config", str(config), "--no-progress"]
    runs = {"default": [], "explicit": ["--grad-accum", "1", "--val-samples", "0", "--eval-every", "3"],
            "validated": ["--val-store", other_store, "--eval-every", "2"]}
    for name, flags in runs.items():
        result = CliRunner().invoke(train_command, [*common, "--out", str(tmp_path / name), *flags])
        assert result.exit_code == 0, result.output
    assert _weights(tmp_path / "default") == _weights(tmp_path / "explicit") == _weights(tmp_path / "validated")
    steps = _lines(tmp_path / "default")
    validated = _lines(tmp_path / "validated")
    assert [m for m in validated if "split" not in m] == steps
    val = [m for m in validated if m.get("split") == "val"]
    assert [m["step"] for m in val] == [2, 4, 6] and len(steps) == 6 and all(m["samples"] == 5 for m in val)
    assert "held-out loss" in result.output


def _one_step(store: str, tmp_path: Path, config: TrainConfig, stage: int) -> tuple[dict, dict, list[int]]:
    """(metrics, gradients, micro-batch rows) of the first optimizer step of `stage`."""
    with distributed.session("cpu") as ctx:
        run = trainer._start_run([store], tmp_path / f"run-{config.grad_accum}", config, resume=False,
                                 cache_dir=None, ctx=ctx, verify_store=False)
        epoch = 0 if stage == 1 else config.stage1_epochs
        _, batches, wait = next(trainer._step_batches(run, epoch, 0))
        metrics = trainer._optimizer_step(run, distributed.loss_runner(run.model, ctx),
                                          trainer._stage_loss(config, stage), batches, wait, stage=stage, epoch=epoch)
        grads = {name: p.grad.clone() for name, p in run.model.named_parameters()}
    return metrics, grads, [len(b.lengths) for b in batches]


@pytest.mark.parametrize("drafter, residual, stage", [("beagle", "embedding", 1), ("beagle", "embedding", 2),
                                                      ("beagle", "state", 2), ("eagle2", "embedding", 1)])
def test_two_micro_batches_of_half_the_batch_give_the_whole_batch_gradient(store, tmp_path, drafter, residual, stage):
    """--grad-accum 2 splits each batch's rows in two halves; the step's gradient (after clipping) and its
    loss equal one pass over the whole batch up to fp32 summation order. Key noise is on: each half must get
    its rows' noise, and each half's loss must be normalised by the whole batch's row weights."""
    config = TrainConfig(**{**FAST, "drafter": drafter, "residual": residual, "min_batch_rows": 2,
                            "grad_clip": 1e6, "batch_tokens": 320,
                            "bf16": False})  # fp32: bf16 rounds each half's weight gradient (0.2% apart)
    whole, whole_grads, whole_rows = _one_step(store, tmp_path, config, stage)
    halves, half_grads, half_rows = _one_step(store, tmp_path, replace(config, grad_accum=2), stage)
    assert len(whole_rows) == 1 and len(half_rows) == 2 and sum(half_rows) == whole_rows[0] >= 2
    assert halves["rows"] == whole["rows"] and halves["tokens"] == whole["tokens"]
    assert halves["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert halves["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(half_grads[name], grad, rtol=1e-4, atol=1e-7 * float(whole["grad_norm"]))


def test_each_forms_weights_are_the_denominators_its_loss_normalises_by(store):
    data = StoreSet([store], key_layers=(1,))
    batch = collate([data.sample(i, 100) for i in range(3)])
    settings = trainer.StageSettings.from_config(TrainConfig(**FAST), 1.0)
    for form in FORMS.values():
        from beagle.model import DrafterConfig

        head = data.load_head()
        config = DrafterConfig.from_architecture(data.target["architecture"])
        config = replace(config, residual=form.residual, key_layers=(1,) if form.residual == "state" else (-1,))
        model = form.build(config, head["embed_tokens"], head["lm_head"])
        for stage in (1, 2):
            for offset in range(3):
                sums = form.stage_loss(stage)(model, batch, offset, settings).sums
                assert torch.equal(form.stage_weights(stage)(batch, offset, settings), sums.weight), (form.name, stage)


@pytest.mark.slow
def test_held_out_samples_never_reach_a_training_batch(store, tmp_path, monkeypatch):
    """Every sample the loader threads read is a training sample; the held-out ones are read by the
    evaluation alone. The split is the seed's, recorded in run_config.json."""
    read: list[tuple[str, int]] = []
    original = StoreSet.sample

    def recording(self, index, *args, **kwargs):
        read.append((threading.current_thread().name, int(index)))
        return original(self, index, *args, **kwargs)

    monkeypatch.setattr(StoreSet, "sample", recording)
    config = TrainConfig(**{**FAST, "val_samples": 5, "eval_every": 2, "stage1_epochs": 2})
    train([store], tmp_path / "run", config)
    recorded = json.loads((tmp_path / "run" / "run_config.json").read_text())["validation"]
    held = set(recorded["indices"])
    assert len(held) == 5 and recorded["held_out"] and recorded["samples"] == 5
    by_loader = {i for thread, i in read if thread.startswith("beagle-data")}
    assert by_loader == set(range(16)) - held  # every training sample, no held-out one
    assert held <= {i for thread, i in read if not thread.startswith("beagle-data")}
    other_seed = trainer.open_validation(StoreSet([store]), replace(config, seed=1), world_size=1)[1]
    assert set(other_seed.indices) != held and len(other_seed.indices) == 5


@pytest.mark.slow
def test_validation_lines_survive_a_resume_and_match_an_uninterrupted_run(store, tmp_path):
    """Both stages, validation every 3 steps and at the end; the interrupted run stops at step 7 (validating
    there, its end) with its last checkpoint at 4, so steps 5..7 and the validations at 6 and 7 are dropped and
    the resumed run validates at 6 and at its own end again."""
    config = TrainConfig(**{**FAST, "batch_tokens": 80, "val_samples": 4, "eval_every": 3})
    full = train([store], tmp_path / "full", config, on_finish=draw_run_curves)
    part = tmp_path / "part"
    train([store], part, config.override(max_steps=7))
    shutil.rmtree(part / "checkpoints" / "step-00000007")
    resumed = train([store], part, config, resume=True)
    assert resumed.steps == full.steps > 8
    lines, resumed_lines = _lines(tmp_path / "full"), _lines(part)
    val = [m for m in lines if m.get("split") == "val"]
    assert [m["step"] for m in val] == [*range(3, full.steps + 1, 3)] + ([] if full.steps % 3 == 0 else [full.steps])
    assert {m["stage"] for m in val} == {1, 2}
    for m in val:
        assert len(m["acceptance"]) == 3 and 1.0 <= m["tau"] <= 4.0 and m["samples"] == 4 and m["roots"] > 0
        assert len(m["accuracy"]) == 3 and m["loss"] > 0
    assert resumed_lines == lines  # every step and every validation, to the bit (fp32 or bf16 alike on a CPU)
    assert _weights(tmp_path / "full") == _weights(part)
    assert full.validation["step"] == full.steps
    from PIL import Image

    assert Image.open(tmp_path / "full" / "curves.png").size[0] == 1600  # the held-out panel was drawn


@pytest.mark.slow
def test_the_trainers_tau_is_the_bench_estimators_on_the_held_out_samples(tmp_path):
    """The last validation's acceptance equals the offline chain of the exported drafter over the held-out
    samples (bench's path: one sample per batch, fp32 store head), on a store small enough to accept drafts."""
    from beagle.drafter_folder import load_drafter

    url = build_tiny_store(tmp_path / "s8", num_samples=12, min_len=10, max_len=30, vocab_size=8)
    config = TrainConfig(**{**FAST, "stage1_epochs": 20, "max_steps": 40, "val_samples": 4, "eval_every": 40})
    result = train([url], tmp_path / "run", config)
    data = StoreSet([url])
    head = data.load_head()
    model, _ = load_drafter(tmp_path / "run" / "drafter", embed_tokens=head["embed_tokens"], lm_head=head["lm_head"])
    held = json.loads((tmp_path / "run" / "run_config.json").read_text())["validation"]["indices"]
    bench = store_acceptance(model, data, held, depth=3, limit=160)
    assert bench.tau > 1.0
    assert (result.validation["tau"], result.validation["acceptance"], result.validation["roots"]) == \
        (pytest.approx(bench.tau), pytest.approx(bench.alphas), bench.roots)
    # a padded batch of several samples counts what the samples count one by one
    batch = collate([data.sample(i, 160) for i in held])
    per_sample = sum(batch_acceptance(model, collate([data.sample(i, 160)]), head["lm_head"], depth=3) for i in held)
    assert torch.equal(batch_acceptance(model, batch, head["lm_head"], depth=3), per_sample)


def test_bad_flags_are_refused_with_the_flag_and_the_fix(store, other_store, tmp_path):
    def refusal(*flags: str) -> str:
        result = CliRunner().invoke(train_command, ["--store", store, "--out", str(tmp_path / "r"), "--no-progress",
                                                    "--batch-tokens", "160", "--max-steps", "1", *flags])
        assert result.exit_code == 2, result.output
        return " ".join(result.output.split())

    assert "val_samples=-1 must be >= 0 (--val-samples" in refusal("--val-samples", "-1")
    assert "eval_every=0 must be >= 1 (--eval-every" in refusal("--eval-every", "0")
    assert "grad_accum=0 must be >= 1 (--grad-accum" in refusal("--grad-accum", "0")
    assert "--val-samples 16 leaves no training sample: the stores hold 16 samples; hold out fewer (at most 15)" \
        in refusal("--val-samples", "16")
    assert "exceeds the 5 samples of --val-store" in refusal("--val-store", other_store, "--val-samples", "6")
    assert "is one of the training stores" in refusal("--val-store", store)
    foreign = build_tiny_store(tmp_path / "foreign", num_samples=3, model_seed=1)
    assert "validate on a store of the same target" in refusal("--val-store", foreign)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_resume_with_another_split_is_refused(store, tmp_path):
    run = tmp_path / "run"
    train([store], run, TrainConfig(**{**FAST, "max_steps": 2, "val_samples": 3}))
    with pytest.raises(ValueError, match=r"changed settings \['val_samples'\]"):
        train([store], run, TrainConfig(**{**FAST, "max_steps": 4, "val_samples": 4}), resume=True)
    record = json.loads((run / "run_config.json").read_text())
    record["validation"]["indices"][0] += 1  # as if the split's rule had changed under the same settings
    (run / "run_config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="would validate on other samples"):
        train([store], run, TrainConfig(**{**FAST, "max_steps": 4, "val_samples": 3}), resume=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_ranks_accumulating_and_validating_match_one_process(store, tmp_path):
    """2 gloo ranks x 2 micro-batches against one process x 2 micro-batches (the same batch plan: 4 rows at
    least): the steps' losses, the validations (each rank scores half the held-out batches, summed) and the
    weights agree to fp32 summation order."""
    settings = {**FAST, "min_batch_rows": 4, "batch_tokens": 320, "grad_accum": 2, "val_samples": 4,
                "eval_every": 2, "bf16": False}
    config = tmp_path / "train.json"
    config.write_text(json.dumps(settings))
    single = train([store], tmp_path / "single", TrainConfig(**settings))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), "-m", "pipeline.commands.train", "--store", store, "--out",
         str(tmp_path / "ddp"), "--config", str(config), "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = _lines(tmp_path / "single"), _lines(tmp_path / "ddp")
    assert [(m["step"], m.get("split")) for m in a] == [(m["step"], m.get("split")) for m in b]
    assert sum(1 for m in a if m.get("split") == "val") >= 2 and single.steps >= 2
    for x, y in zip(a, b):
        assert x["rows"] == y["rows"] and x["tokens"] == y["tokens"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        if x.get("split") == "val":
            assert (y["samples"], y["roots"]) == (x["samples"], x["roots"])
            assert y["tau"] == pytest.approx(x["tau"], abs=0.02)
    wa, wb = load_file(str(tmp_path / "single" / "drafter" / "model.safetensors")), \
        load_file(str(tmp_path / "ddp" / "drafter" / "model.safetensors"))
    for name in wa:
        assert (wa[name] - wb[name]).abs().mean() < 5e-5, name
