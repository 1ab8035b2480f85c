"""The `beagle-pipeline` command line.

Subcommands live next to the code they drive and are imported only when invoked, so that
`beagle-pipeline train` never imports Ray and `beagle-pipeline info` never imports torch models.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging

import click

from pipeline.dependency_floors import refuse_old_dependencies

# name -> "module:attribute" of a click.Command. Kept in one table so `--help` lists them all.
_COMMANDS: dict[str, str] = {
    "prepare-demo": "pipeline.demo.cli:prepare_demo",
    "regenerate": "pipeline.regenerate.cli:regenerate",
    "extract": "pipeline.extract.cli:extract",
    "info": "pipeline.commands.store:info",
    "verify": "pipeline.commands.store:verify",
    "merge": "pipeline.commands.store:merge",
    "ls": "pipeline.commands.store:list_stores_command",
    "train": "pipeline.commands.train:train",
    "eval": "pipeline.commands.eval:evaluate",
    "export": "pipeline.commands.export:export",
    "export-features": "pipeline.commands.export_features:export_features",
}


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is absent
        return False


class _LazyGroup(click.Group):
    """A click group that imports each subcommand's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        present = [name for name, target in _COMMANDS.items() if _module_exists(target.split(":")[0])]
        return present + sorted(super().list_commands(ctx))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Train Beagle speculative-decoding drafters from stored LLM features.

    \b
    Typical flow:
      beagle-pipeline regenerate --model TARGET --data chats.jsonl --out answers.jsonl  (optional)
      beagle-pipeline extract --model TARGET --data answers.jsonl --out STORE
      beagle-pipeline train --store STORE --out RUN
      beagle-pipeline eval --model TARGET --drafter RUN/drafter --prompts question.jsonl
    """
    refuse_old_dependencies()
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
