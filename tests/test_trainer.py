"""The trainer end to end on tiny real stores: learning, resume, export, refusals, config, no Ray."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from beagle.data import StoreSet, collate
from beagle.drafter_folder import load_drafter
from beagle.model import BeagleDrafter, DrafterConfig
from pipeline.commands.train import train as train_command
from beagle.train_config import TrainConfig, load_config_file
from beagle.trainer import train
from pipeline.commands.curves import draw_run_curves
from tests.tiny_store import build_tiny_store

FAST = dict(batch_tokens=160, lr=3e-3, warmup_steps=3, window_size=3, simulation_steps=2,
            checkpoint_every=4, vocab_chunk=128)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_tiny_store(tmp_path_factory.mktemp("store") / "a", num_samples=16)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_loss_falls_on_a_tiny_store(store, tmp_path):
    config = TrainConfig(**{**FAST, "stage1_epochs": 16, "stage2_epochs": 0, "max_steps": 40})
    result = train([store], tmp_path / "run", config)
    losses = _losses(tmp_path / "run")
    assert result.steps == len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"step", "stage", "loss", "token_loss", "regression_loss", "accuracy", "tokens_per_s",
            "data_wait_fraction"} <= set(line)
    assert len(line["accuracy"]) == 3 and 0 <= line["data_wait_fraction"] <= 1


@pytest.mark.slow
def test_resume_matches_an_uninterrupted_run(store, tmp_path):
    """Both stages; the interrupted run 'crashes' after step 10 with its last checkpoint at step 8."""
    config = TrainConfig(**{**FAST, "batch_tokens": 80, "stage1_epochs": 1, "stage2_epochs": 1})
    full = train([store], tmp_path / "full", config)
    assert {json.loads(x)["stage"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()} == {1, 2}
    part = tmp_path / "part"
    train([store], part, config.override(max_steps=10))
    shutil.rmtree(part / "checkpoints" / "step-00000010")       # lines 9..10 must be recomputed
    resumed = train([store], part, config, resume=True)
    assert resumed.steps == full.steps > 12
    assert _losses(part) == _losses(tmp_path / "full")
    a = load_file(str(tmp_path / "full" / "drafter" / "model.safetensors"))
    b = load_file(str(part / "drafter" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_export_reload_gives_identical_logits(store, tmp_path):
    run = tmp_path / "run"
    train([store], run, TrainConfig(**{**FAST, "max_steps": 5}), on_finish=draw_run_curves)
    assert (run / "curves.png").stat().st_size > 0  # drawn by the command's hook: the library draws nothing
    meta = json.loads((run / "drafter" / "config.json").read_text())
    data = StoreSet([store])
    assert meta["drafter_type"] == "beagle" and meta["dataset_ids"] == data.dataset_ids
    assert meta["target"]["weights_sha256"] == data.target["weights_sha256"]
    head = data.load_head()
    loaded, _ = load_drafter(run / "drafter", embed_tokens=head["embed_tokens"], lm_head=head["lm_head"])
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    ref = BeagleDrafter(DrafterConfig.from_dict({k: meta[k] for k in DrafterConfig.__dataclass_fields__}),
                        head["embed_tokens"], head["lm_head"])
    ref.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    batch = collate([data.sample(0, 100)])
    L = batch.input_ids.shape[1]
    pos = torch.arange(L)[None]
    mask = torch.ones(L, L).tril(-1).bool()[None, None]
    with torch.no_grad():
        a = ref.logits(ref.forward_hidden(batch.input_ids, pos, *ref.project_keys(batch.hidden, pos), mask))
        b = loaded.logits(loaded.forward_hidden(batch.input_ids, pos, *loaded.project_keys(batch.hidden, pos), mask))
    assert torch.equal(a, b)
    assert set(load_file(str(run / "drafter" / "model.safetensors"))) == set(ref.state_dict())


@pytest.mark.slow
def test_refuses_mixed_targets_and_resume_on_another_target(store, tmp_path):
    other = build_tiny_store(tmp_path / "b", num_samples=4, model_seed=1)
    with pytest.raises(ValueError, match="different targets.*tiny-llama-0.*tiny-llama-1"):
        train([store, other], tmp_path / "mixed", TrainConfig(**FAST))
    run = tmp_path / "run"
    train([store], run, TrainConfig(**{**FAST, "max_steps": 2}))
    with pytest.raises(ValueError, match="differs from the run's target"):
        train([other], run, TrainConfig(**{**FAST, "max_steps": 4}), resume=True)
    wide = build_tiny_store(tmp_path / "c", num_samples=4, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="differs"):
        train([wide], run, TrainConfig(**{**FAST, "max_steps": 4}), resume=True)
    with pytest.raises(ValueError, match="already holds a run"):
        train([store], run, TrainConfig(**FAST))


def test_config_file_loads_rejects_unknown_keys_and_flags_override(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("window_size = 3\nsimulation_steps = 2\nlr = 0.001\n")
    config = load_config_file(toml)
    assert (config.window_size, config.simulation_steps, config.lr) == (3, 2, 0.001)
    assert config.override(lr=0.5, seed=None).lr == 0.5 and config.override(seed=None).seed == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"window_size": 3, "windowsize": 4}))
    with pytest.raises(ValueError, match="unknown training option.*windowsize"):
        load_config_file(bad)
    with pytest.raises(ValueError, match="simulation_steps=6"):
        TrainConfig(window_size=5, simulation_steps=6)
    with pytest.raises(ValueError, match="regression_weight must be >= 0"):
        TrainConfig(regression_weight=-1.0)


@pytest.mark.slow
def test_cli_trains_with_config_file_and_flags(store, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**FAST, "max_steps": 50}))
    result = CliRunner().invoke(train_command, ["--store", store, "--out", str(tmp_path / "run"),
                                                "--config", str(cfg), "--max-steps", "3", "--regression-weight", "0",
                                                "--no-progress"])
    assert result.exit_code == 0, result.output
    run_config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert run_config["config"]["max_steps"] == 3 and run_config["config"]["window_size"] == 3
    assert run_config["config"]["regression_weight"] == 0
    assert run_config["noise_std_relative"] == 0.2 and run_config["noise_std_absolute"] > 0
    bad = CliRunner().invoke(train_command, ["--store", store, "--out", str(tmp_path / "r2"),
                                             "--window-size", "2", "--simulation-steps", "3"])
    assert bad.exit_code == 2 and "simulation_steps=3" in bad.output


@pytest.mark.slow
def test_training_imports_neither_ray_nor_transformers(store, tmp_path):
    code = (
        "import sys\n"
        "from beagle.trainer import train\n"
        "from pipeline.commands.train import train as cli\n"
        "from beagle.train_config import TrainConfig\n"
        f"train([{store!r}], {str(tmp_path / 'run')!r}, TrainConfig(max_steps=2, batch_tokens=160))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_a_reduced_draft_vocabulary_trains_the_token_loss_on_it_and_is_exported(store, tmp_path):
    from beagle.decoding.draft_vocab import frequent_tokens
    from beagle.model import loss_head, restrict_loss_vocabulary
    from beagle.stages import StageSettings, stage1_loss

    config = TrainConfig(**{**FAST, "stage1_epochs": 1, "stage2_epochs": 1, "max_steps": 6, "draft_vocab": 20})
    train([store], tmp_path / "run", config)
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    data = StoreSet([store])
    tokens = frequent_tokens(data.stores, 20, data.target["architecture"]["vocab_size"])
    assert exported["draft_vocab"] == tokens.tolist() and len(tokens) == 20

    head = data.load_head()
    model = BeagleDrafter(DrafterConfig.from_architecture(data.target["architecture"]),
                          head["embed_tokens"], head["lm_head"])
    batch = collate([data.sample(i, 1000) for i in range(4)])
    settings = StageSettings(window_size=3, simulation_steps=2,
                             noise_std=0.0, regression_weight=0.0, vocab_chunk=128)  # token loss only
    full = stage1_loss(model, batch, 0, settings).finish().loss
    restrict_loss_vocabulary(model, tokens)
    assert torch.equal(loss_head(model), head["lm_head"][tokens])
    reduced = stage1_loss(model, batch, 0, settings).finish().loss
    assert 0 < reduced < full  # a soft CE over 20 tokens instead of the whole vocabulary


def test_batches_for_a_gpu_keep_the_stores_bf16_and_are_cast_on_the_device(tmp_path):
    """For a CUDA run the loader reads states as stored (bf16: half the bytes to copy) and `Batch.to` casts
    them on the device; the values equal the CPU path's fp32 batch exactly (bf16 -> fp32 is exact)."""
    from beagle.data import Loader, plan_epoch

    data = StoreSet([build_tiny_store(tmp_path / "bf16", num_samples=6, dtype="bfloat16")])
    plan = plan_epoch(data.lengths, batch_tokens=160, limit=64, seed=0, epoch=0)
    on_cpu = Loader(data, plan, limit=64)
    for_gpu = Loader(data, plan, limit=64, device=torch.device("cuda"))  # no batch is read: nothing needs CUDA
    assert not on_cpu.to_gpu and for_gpu.to_gpu
    rows = plan[0]
    stored = collate(for_gpu._samples(rows))
    assert stored.hidden.dtype == torch.bfloat16
    moved = stored.to(torch.device("cpu"))
    reference = collate(on_cpu._samples(rows))
    assert reference.hidden.dtype == torch.float32 and moved.hidden.dtype == torch.float32
    assert torch.equal(moved.hidden, reference.hidden) and torch.equal(moved.input_ids, reference.input_ids)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_the_learning_rate_warms_up_then_follows_its_schedule_to_the_last_step(schedule, store, tmp_path):
    """Warm-up is linear for every schedule; cosine and linear decay reach 0 at the run's last step, and the
    rate a run logs is the schedule's (metrics.jsonl), not just what the function returns."""
    from beagle.trainer import _learning_rate
    config = TrainConfig(lr=1e-3, warmup_steps=4, lr_schedule=schedule)
    rates = [_learning_rate(config, step, 20) for step in range(20)]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    if schedule == "constant":
        assert rates[4:] == pytest.approx([1e-3] * 16)
    else:
        assert all(a > b for a, b in zip(rates[3:], rates[4:])) and rates[-1] == pytest.approx(0.0, abs=1e-12)
    if schedule == "cosine":
        assert rates[11] == pytest.approx(5e-4, rel=0.1)   # half way through the decay
    with pytest.raises(Exception, match="lr_schedule"):
        TrainConfig(lr_schedule="step")
    run = tmp_path / schedule
    train([store], run, TrainConfig(stage1_epochs=1, stage2_epochs=1, max_steps=6, batch_tokens=256, lr=1e-3,
                                    warmup_steps=2, lr_schedule=schedule, bf16=False, vocab_chunk=128))
    logged = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("split", "train") == "train"]
    assert logged == pytest.approx([_learning_rate(TrainConfig(lr=1e-3, warmup_steps=2, lr_schedule=schedule), s, 6)
                                    for s in range(6)])


def test_a_run_records_its_stores_absolutely_and_export_refuses_another_store_at_that_path(tmp_path, monkeypatch):
    """A run trained on `--store st` (relative) must not make `export`, run from a folder that holds another
    target's store named `st`, write that target's head: the run records the path absolutely, and export
    checks the store's dataset_id against the drafter's before it reads a head."""
    from pipeline.cli import main as cli_main

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    build_tiny_store(here / "st", num_samples=8, layers=(1, -1))
    build_tiny_store(elsewhere / "st", num_samples=8, layers=(1, -1), model_seed=7)
    monkeypatch.chdir(here)
    train(["st"], tmp_path / "run", TrainConfig(**{**FAST, "max_steps": 2, "residual": "state"}))
    recorded = json.loads((tmp_path / "run" / "run_config.json").read_text())["stores"]
    assert recorded == [str(here / "st")]
    drafter_meta = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert drafter_meta["stores"] == [str(here / "st")]
    for key in ("stores",):  # as a run recorded before this fix: the relative name
        drafter_meta[key] = ["st"]
    (tmp_path / "run" / "drafter" / "config.json").write_text(json.dumps(drafter_meta))
    (tmp_path / "run" / "run_config.json").write_text(json.dumps({"stores": ["st"]}))
    monkeypatch.chdir(elsewhere)
    result = CliRunner().invoke(cli_main, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "e3")])
    assert result.exit_code == 1 and "is now another store" in result.output, result.output
    assert not (tmp_path / "e3").exists()
    monkeypatch.chdir(here)
    result = CliRunner().invoke(cli_main, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "e3")])
    assert result.exit_code == 0, result.output


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_samples(tmp_path):
    """One NaN in a store's states used to train every weight to NaN and end with rc 0, `metrics.jsonl`
    holding bare NaN; the run now stops at that step, before logging or saving it."""
    store = build_tiny_store(tmp_path / "st", num_samples=6, nan_sample=2, layers=(1, -1))
    with pytest.raises(ValueError, match=r"step \d+ \(epoch \d+\): the loss is nan on samples \[.*2.*\]"):
        train([store], tmp_path / "run", TrainConfig(**{**FAST, "max_steps": 20, "batch_tokens": 4000}))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert all("NaN" not in line for line in lines)
    assert not (tmp_path / "run" / "drafter").exists()
