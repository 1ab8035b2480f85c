"""Command-line options whose defaults are read from the library's dataclasses, so that each setting is
said once: in its dataclass field. A default shown in `--help` is rendered from that field, never retyped
(tests/test_settings_once.py checks every command).

Two kinds:
- `default_option`: the option's default IS the field's default (eval's draft shape);
- `override_option`: the option defaults to None, meaning "not given": a config file or another source
  decides, and the help shows the field's default in brackets (train, where `--config FILE` sits between).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import click


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its default_factory called); KeyError if it has none."""
    for field in dataclasses.fields(cls):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                return field.default_factory()  # type: ignore[misc]
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def render_default(value: Any) -> str:
    """A default as `--help` shows it: flags as on/off, sequences comma-separated, None as none."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def default_option(cls: type, name: str, *param_decls: str, help: str, **kwargs: Any) -> Callable:
    """An option defaulting to `cls.name`'s default, shown as `[default: ...]`."""
    return click.option(*param_decls, name, default=field_default(cls, name), show_default=True, help=help,
                        **kwargs)


def override_option(cls: type, name: str, *param_decls: str, help: str, default_note: str | None = None,
                    **kwargs: Any) -> Callable:
    """An option that is None unless given, its help ending in `[<cls.name's default>]` (or `[default_note]`
    for a default the library decides at run time, e.g. by device)."""
    note = default_note if default_note is not None else render_default(field_default(cls, name))
    return click.option(*param_decls, name, default=None, help=f"{help} [{note}]", **kwargs)
