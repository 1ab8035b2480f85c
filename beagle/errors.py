"""The errors the library raises for what a user can fix. Each message is one line naming the file or the
setting and the fix; the command line maps the kind to an exit status in one place
(pipeline/commands/errors.py): a setting that cannot be used is a usage error (exit 2), a file, folder or
run state that cannot be used is a data error (exit 1). Each also inherits ValueError, the builtin a caller
would naturally catch."""
from __future__ import annotations

import dataclasses
import math


class BeagleError(ValueError):
    """Base class: something the user gave cannot be used; the message says what and how to fix it."""


class SettingsError(BeagleError):
    """A setting is out of range or contradicts another (a usage error: the command line was wrong)."""


class InputError(BeagleError):
    """A file or folder given (a target, a drafter, a prompt file) cannot be used as it is."""


class RunStateError(BeagleError):
    """The run directory's state forbids the command (a resume of another recipe, a foreign folder)."""


def refuse_non_finite(config: object) -> None:
    """A SettingsError naming the first float field of the dataclass `config` that is nan or inf: range checks
    (`x >= 0`, `x > 0`) let both through (nan compares False, inf passes), and either trains or samples to NaN."""
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise SettingsError(f"--{field.name.replace('_', '-')} {value}: must be a finite number")
