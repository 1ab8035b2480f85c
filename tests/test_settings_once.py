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
CONFIG_FILE_ONLY = {"min_batch_rows", "weight_decay", "betas", "grad_clip", "stage2_recompute", "rms_samples"}


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
