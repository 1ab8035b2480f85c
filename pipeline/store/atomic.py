"""Atomic, durable writes: the one helper behind every file and directory this project commits.

A file is written to a temporary name in its own directory, flushed and fsynced, renamed over the
target with `os.replace`, and then the directory is fsynced, so that after a crash (even a power loss) a
reader finds the old content or the whole new content, never a torn file or a name pointing nowhere.
A directory is built aside, every file and folder in it fsynced, then renamed into place the same way.
Object stores (fsspec URLs that are not local) make a single put atomic themselves; there `write_bytes`
just puts the object.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pipeline.store.format import is_local

PathLike = str | os.PathLike


def write_bytes(path: PathLike, payload: bytes, *, fs: Any = None) -> None:
    """Replace `path` by `payload` atomically and durably. `fs`: an fsspec filesystem for `path`
    (None: local disk); on a non-local one the object is put in one request."""
    if fs is not None and not is_local(fs):
        with fs.open(str(path), "wb") as handle:
            handle.write(payload)
        return
    path = os.fspath(path)
    temporary = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_text(path: PathLike, text: str, *, encoding: str = "utf-8", fs: Any = None) -> None:
    """`write_bytes` for text."""
    write_bytes(path, text.encode(encoding), fs=fs)


def holds_current_folder(path: PathLike) -> bool:
    """Whether `path` is the current folder or one above it (the filesystem root included): a directory
    `commit_directory` must never replace (the rename fails with EBUSY, and the work done is lost)."""
    path, cwd = Path(path).resolve(), Path.cwd().resolve()
    return path == cwd or path in cwd.parents


def commit_directory(staging: PathLike, final: PathLike, *, replace: bool) -> bool:
    """Rename the finished local directory `staging` to `final`, durably: its files and folders are
    fsynced first and the parent after. If `final` exists: with `replace`, it is moved aside, swapped
    and deleted (readers see the old or the new directory, whole); without, `final` is kept (an earlier
    attempt committed the same content), `staging` is deleted and False is returned."""
    staging, final = Path(staging), Path(final)
    fsync_tree(staging)
    if final.exists():
        if not replace:
            shutil.rmtree(staging, ignore_errors=True)
            return False
        retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, retired / final.name)
        os.rename(staging, final)
        fsync_dir(final.parent)
        shutil.rmtree(retired, ignore_errors=True)
        return True
    os.rename(staging, final)
    fsync_dir(final.parent)
    return True


def fsync_tree(directory: PathLike) -> None:
    """fsync every file and folder under `directory` (bottom-up, so each folder after its entries)."""
    for folder, _, names in os.walk(directory, topdown=False):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def fsync_dir(directory: PathLike) -> None:
    """fsync a directory, which makes the names created, renamed or deleted in it durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
