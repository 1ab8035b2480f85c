"""One mapping from the library's errors to exit statuses (pipeline/commands/errors.py): a usage error
exits 2 with click's banner, a data or state error exits 1 with one line naming the file and the fix, and
a bug keeps its traceback."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from beagle.errors import InputError, RunStateError, SettingsError
from pipeline.commands.errors import reports_errors
from pipeline.store.errors import StoreFormatError, StoreNotFoundError


def _command(error: BaseException) -> click.Command:
    @click.command()
    @reports_errors
    def command() -> None:
        raise error
    return command


@pytest.mark.parametrize("error, status", [
    (SettingsError("--depth 0: draft at least one token"), 2),
    (InputError("drafter d was trained for vocab_size=80; pass the --model it was trained on"), 1),
    (RunStateError("--resume with stores [b], but the run in r trained on [a]"), 1),
    (StoreFormatError("s/manifest.json: not valid JSON"), 1),
    (StoreNotFoundError("no store at s"), 1),
    (ValueError("a plain ValueError from deeper down\nwith a second line"), 1),
    (FileNotFoundError("prompts.jsonl not found"), 1),
])
def test_each_kind_of_error_gets_its_exit_status_and_one_line(error, status):
    result = CliRunner().invoke(_command(error), [])
    assert result.exit_code == status, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1] == f"Error: {str(error).splitlines()[0]}"
    assert ("Usage:" in result.output) == (status == 2)
    assert "Traceback" not in result.output


def test_a_bug_is_not_dressed_up_as_a_usage_error():
    result = CliRunner().invoke(_command(RuntimeError("bug")), [])
    assert isinstance(result.exception, RuntimeError)


def test_eval_says_a_contradicting_flag_is_a_usage_error_and_a_missing_drafter_a_data_error(tmp_path):
    from pipeline.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "drafter").mkdir()
    base = ["eval", "--model", str(tmp_path / "model"), "--drafter", str(tmp_path / "drafter"),
            "--prompts", str(prompts), "--no-progress"]
    usage = CliRunner().invoke(main, base + ["--min-confidence", "0.3", "--temperature", "0.5"])
    assert usage.exit_code == 2 and "--min-confidence works with --temperature 0 only" in usage.output
    data = CliRunner().invoke(main, base)
    assert data.exit_code == 1 and "config.json" in data.output and "Usage:" not in data.output, data.output


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_float_settings_refuse_nan_and_inf(value):
    """Range checks let nan and inf through (nan compares False; inf passes `x >= 0`); each trained or sampled
    to NaN. Every float setting of training, drafting and regeneration refuses them by name."""
    from beagle.decoding.tree import DraftConfig
    from beagle.errors import SettingsError
    from beagle.train_config import TrainConfig
    from pipeline.regenerate.generation import GenerateConfig
    from pipeline.regenerate.job import RegenerateConfig, _check

    for build, flag in ((lambda: TrainConfig(lr=float(value)), "--lr"),
                        (lambda: TrainConfig(regression_weight=float(value)), "--regression-weight"),
                        (lambda: TrainConfig(noise_std=float(value)), "--noise-std"),
                        (lambda: DraftConfig(temperature=float(value)), "--temperature"),
                        (lambda: _check(RegenerateConfig(GenerateConfig("m", temperature=float(value)), ("d",),
                                                         "o.jsonl")), "--temperature")):
        with pytest.raises(SettingsError, match=f"^{flag} {value}: must be a finite number"):
            build()


def test_train_and_eval_refuse_an_infinite_rate_or_temperature_on_the_command_line(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    result = CliRunner().invoke(main, ["train", "--store", str(tmp_path), "--out", str(tmp_path / "r"),
                                       "--lr", "inf"])
    assert result.exit_code == 2 and "--lr inf: must be a finite number" in result.output, result.output
