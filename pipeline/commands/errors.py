"""The one mapping from the library's errors to exit statuses and one-line messages.

- a usage error (a setting out of range, flags that contradict each other: `beagle.errors.SettingsError`,
  click's own) exits 2 with click's usage banner;
- a data or state error (a store, a target, a drafter, a prompt file or a run directory that cannot be used:
  `pipeline.store.StoreError`, `beagle.errors.BeagleError`, any other ValueError or a missing file) exits 1
  with `Error: <one line>`;
- anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import click

from beagle.errors import SettingsError
from pipeline.store.errors import StoreError

USAGE_EXIT, DATA_EXIT = 2, 1


def one_line(error: BaseException) -> str:
    """The first line of an error's message (or its type's name when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def as_click_error(error: Exception) -> click.ClickException:
    """The click exception that reports `error` with its exit status."""
    if isinstance(error, SettingsError):
        return click.UsageError(one_line(error))
    exception = click.ClickException(one_line(error))
    exception.exit_code = DATA_EXIT
    return exception


def reports_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command's callback so that a library error ends it with its exit status and one line."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except click.ClickException:
            raise
        except (StoreError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as error:
            raise as_click_error(error) from None
    return run
