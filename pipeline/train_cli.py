"""`beagle-pipeline train`: beagle's one-process train command, plus the Ray Train path.

`beagle.train_cli.train` trains in this process (or in one torchrun rank) and never imports Ray. This
command has all of its options and two more, --num-workers and --address: given --num-workers, the same
training loop runs on N Ray Train workers (`pipeline.train_launch`); without it, beagle's command runs.
"""
from __future__ import annotations

from typing import Any

import click

from beagle.train_cli import RUN_OPTIONS, build_config
from beagle.train_cli import train as train_here
from beagle.train_config import TrainConfig

_RAY_OPTIONS = [
    click.Option(["--num-workers"], type=int,
                 help="Train on N Ray Train workers (DDP; one GPU each where the cluster has GPUs)."),
    click.Option(["--address"], help="Ray cluster to join with --num-workers (default: RAY_ADDRESS or a local Ray)."),
]


def _params() -> list[click.Parameter]:
    """beagle's options with the Ray ones after --cache-dir, where `--help` has always listed them."""
    params = list(train_here.params)
    at = next(i for i, param in enumerate(params) if param.name == "cache_dir") + 1
    return params[:at] + _RAY_OPTIONS + params[at:]


def _train(num_workers: int | None, address: str | None, **options: Any) -> None:
    if num_workers is None and address is None:
        train_here.callback(**options)
        return
    config = build_config(options["config_file"], {k: v for k, v in options.items() if k not in RUN_OPTIONS})
    if address and num_workers is None:
        raise click.UsageError("--address joins a Ray cluster for Ray Train; give --num-workers N with it")
    _train_on_ray(list(options["stores"]), options["run_dir"], config, num_workers, address, options["resume"],
                  options["cache_dir"])


def _train_on_ray(stores: list[str], run_dir: str, config: TrainConfig, num_workers: int, address: str | None,
                  resume: bool, cache_dir: str | None) -> None:
    from pipeline.train_launch import launch  # the only path that loads Ray

    if num_workers < 1:
        raise click.UsageError(f"--num-workers {num_workers} must be >= 1")
    try:
        final = launch(stores, run_dir, config, num_workers=num_workers, address=address, resume=resume,
                       cache_dir=cache_dir)
    except Exception as exc:  # Ray wraps worker errors (our ValueErrors among them)
        raise click.ClickException(f"Ray Train run failed: {str(exc).strip().splitlines()[-1]}") from exc
    loss = final.get("loss")
    click.echo(f"trained {final.get('steps')} steps on {num_workers} Ray Train workers; final loss "
               f"{float('nan') if loss is None else loss:.4f}; drafter in {run_dir}/drafter")


train = click.Command("train", callback=_train, params=_params(), help=train_here.help,
                      context_settings=train_here.context_settings)
