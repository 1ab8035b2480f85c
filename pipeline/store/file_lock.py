"""One exclusive, non-blocking `flock` for jobs that must never write the same output twice at once."""
from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def exclusive_lock(path: str, busy: Callable[[], Exception]) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the block; raise `busy()` if another
    process holds it. The kernel releases the lock when its holder dies, so a crash never blocks a rerun."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy() from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
