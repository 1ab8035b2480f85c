"""What every job's click command shares: the progress bar and the summary it prints at the end."""
from __future__ import annotations

from typing import Any, Protocol

import click


class TqdmProgress:
    """A tqdm bar over a job's records (`Progress`), with the tokens/s of this run's work in its postfix;
    records kept from an earlier run, and rejects, move the bar but not the speed."""

    def __init__(self, *, desc: str, unit: str, enabled: bool) -> None:
        self.desc, self.unit, self.enabled = desc, unit, enabled
        self.bar: Any = None
        self.tokens = 0

    def start(self, total: int) -> None:
        if self.enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit=self.unit, desc=self.desc, dynamic_ncols=True)

    def advance(self, records: int, tokens: int, *, this_run: bool) -> None:
        if self.bar is None:
            return
        self.bar.update(records)
        if not this_run:
            return
        self.tokens += tokens
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Summary(Protocol):
    state: str  # new | resume(d) | complete (nothing was left to do)

    def lines(self) -> list[str]: ...


def echo_summary(summary: Summary, out: str) -> None:
    """The job's closing lines, saying first when there was nothing to do."""
    if summary.state == "complete":
        click.echo(f"{out} is already complete for these inputs and settings; nothing to do")
    click.echo("\n".join(summary.lines()))
