"""What a job reports while it runs; the CLI draws it (`pipeline.jobkit.cli.TqdmProgress`), library
callers may pass None."""
from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """`total`: the records that passed reading. Each one is reported once: when its chunk is committed in
    this run (`this_run=True`: these make the speed), or found committed by an earlier run, or rejected
    (`this_run=False`), so a bar ends at its total."""

    def start(self, total: int) -> None: ...

    def advance(self, records: int, tokens: int, *, this_run: bool) -> None: ...
