"""A job's output file: one job at a time writes it (`output_lock`), and it appears whole or not at all
(`write_lines`), however large it is.

Feature stores have their own lock (`pipeline.store.writer.store_lock`, which also works on object
storage); these are for jobs whose output is a local file beside which the lock file can live.
"""
from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from pipeline.store.atomic import fsync_dir
from pipeline.store.file_lock import exclusive_lock


def lock_path(out: str) -> Path:
    return Path(out + ".lock")


@contextmanager
def output_lock(out: str) -> Iterator[None]:
    """Hold OUT.lock (flock) for the block, so two jobs never interleave work on one output; a second job
    stops at once with a one-line error naming it. The kernel releases it if the holder dies."""
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(str(path), lambda: ValueError(
            f"--out {out} is being written by another process (it holds {path}); wait for that job to "
            "finish, or choose another --out")):
        yield


def write_lines(path: Path, pieces: Iterable[str], *, encoding: str = "utf-8") -> None:
    """Write the concatenation of `pieces` to `path` atomically and durably, one piece in memory at a time:
    written to a temporary name beside it, fsynced, renamed over it, the folder fsynced (what
    `pipeline.store.atomic.write_bytes` does for a payload held whole)."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(temporary, "w", encoding=encoding) as handle:
            for piece in pieces:
                handle.write(piece)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(str(path.parent) or ".")
