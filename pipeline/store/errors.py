"""Store errors. Each also inherits the builtin a caller would naturally catch."""
from __future__ import annotations


class StoreError(Exception):
    """Base class: something is wrong with a feature store. The message names the path and the fix."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store, or a file it lists, does not exist."""


class StoreFormatError(StoreError, ValueError):
    """The store exists but cannot be read correctly (unknown version, bad manifest, unsafe path)."""


class StoreConflictError(StoreError, FileExistsError):
    """Writing would mix data from different inputs into one store."""
