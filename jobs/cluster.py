"""What every Ray job entry point does: join the cluster the job runs in, then run one CLI command."""
from __future__ import annotations

import logging

import click

from pipeline.dependency_floors import refuse_old_dependencies


def run_joined(command: click.Command, argv: list[str], prog_name: str) -> None:
    """Run `command` with `argv`, joining the job's cluster (`--address auto`) unless told otherwise.

    Inside a Ray job the driver runs on the head node with RAY_ADDRESS set, so the command joins that
    cluster and never starts a local Ray. `-v` turns on INFO logs.
    """
    refuse_old_dependencies()
    args = list(argv)
    if "--address" not in args:
        args += ["--address", "auto"]
    logging.basicConfig(level=logging.INFO if "-v" in args else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    command.main(args=[a for a in args if a != "-v"], prog_name=prog_name)
