"""Each setting is said once, in its dataclass: the commands' options take their defaults from the fields
and show them rendered from there (pipeline/commands/options.py). A help text that names another default
than its field, or a field that gains no option and no reason, fails here."""
from __future__ import annotations

import dataclasses
import re

import click

from beagle.decoding.tree import DraftConfig
from beagle.train_config import TrainConfig
from pipeline.commands.eval import evaluate
from pipeline.commands.options import field_default, render_default
from pipeline.commands.train import train

# Options whose default the library decides at run time, so their help describes it instead of a value.
DESCRIBED_DEFAULTS = {"max_length", "key_layers", "vocab_chunk", "bf16"}
# TrainConfig fields set only in a --config file: optimizer internals and sizes of the noise estimate.
CONFIG_FILE_ONLY = {"min_batch_rows", "betas", "grad_clip", "stage2_recompute", "rms_samples"}


def _options(command: click.Command) -> dict[str, click.Option]:
    return {param.name: param for param in command.params if isinstance(param, click.Option)}


def test_every_train_option_shows_its_fields_default():
    options = _options(train)
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    assert fields - set(options) == CONFIG_FILE_ONLY  # a new field needs an option, or a place in this list
    for name in sorted(fields & set(options)):
        option = options[name]
        assert option.default is None, f"--{name}: a config file could never be overridden back to its default"
        shown = re.search(r"\[([^\[\]]*)\]$", option.help.strip())
        assert shown, f"--{name}: its help shows no default"
        if name not in DESCRIBED_DEFAULTS:
            assert shown.group(1) == render_default(field_default(TrainConfig, name)), name


def test_evals_draft_shape_defaults_are_draft_configs():
    options = _options(evaluate)
    for name in ("depth", "top_k", "total_tokens", "temperature", "min_confidence"):
        assert options[name].default == field_default(DraftConfig, name), name
        assert options[name].show_default


def test_a_flag_left_out_keeps_the_config_files_value(tmp_path):
    from pipeline.commands.train import build_config

    path = tmp_path / "c.toml"
    path.write_text("lr = 0.002\nwindow_size = 3\nsimulation_steps = 2\n")
    config = build_config(str(path), {"lr": None, "window_size": None, "seed": 7})
    assert (config.lr, config.window_size, config.seed) == (0.002, 3, 7)


def _job_options_match_their_fields(command: click.Command, configs: tuple[type, ...], described: set[str]) -> None:
    """Every option named like a field of the job's configs defaults to that field's value (shown in --help)."""
    options = _options(command)
    checked = 0
    for config in configs:
        for field in dataclasses.fields(config):
            option = options.get(field.name)
            if option is None or field.name in described or field.default is dataclasses.MISSING or option.is_flag:
                continue  # a flag is off unless given
            default = option.default
            if field.name == "layers" and default is not None:  # a comma-separated string parsed by a callback
                default = tuple(int(v) for v in str(default).split(","))
            assert default == field_default(config, field.name), f"{command.name} --{field.name}"
            if field.default is not None and not isinstance(field.default, bool):  # None: decided at run time
                assert option.show_default, f"{command.name} --{field.name}: its help shows no default"
                checked += 1
    assert checked >= 6, f"{command.name}: only {checked} options matched config fields"


def test_extract_and_regenerate_defaults_are_their_configs():
    from pipeline.extract.cli import extract
    from pipeline.extract.pipeline import ExtractConfig
    from pipeline.regenerate.cli import regenerate
    from pipeline.regenerate.generation import GenerateConfig
    from pipeline.regenerate.job import RegenerateConfig
    from pipeline.regenerate.vllm_engine import VllmConfig

    # store_dtype, batch_tokens, num_workers, device_map, address, limit: None = decided at run time, and said so
    _job_options_match_their_fields(extract, (ExtractConfig,), {"store_dtype", "batch_tokens"})
    _job_options_match_their_fields(regenerate, (GenerateConfig, RegenerateConfig, VllmConfig), set())
