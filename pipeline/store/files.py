"""Opening a store's files safely: regular files inside the store only, every read bounded.

A store comes from someone else. A name in it may be a symlink to /dev/zero (reads never end), a FIFO
(opening it blocks forever) or a link to a file outside the store. Every file a reader or `verify` opens
goes through here: on local disk it must resolve inside the store and be a regular file, checked on the
opened descriptor itself (`O_NONBLOCK`, so opening a FIFO cannot block, then `fstat`), and no read takes
more than the size the manifest records (or a fixed cap for the manifest and the small JSON files that
have no recorded size). Object stores have neither links nor FIFOs; their reads are bounded the same way.
"""
from __future__ import annotations

import io
import json
import os
import stat
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterator

from pipeline.store import format as fmt
from pipeline.store.errors import StoreFormatError
from pipeline.store.hashing import BLOCK_BYTES, new_digest

# manifest.json: about 1 KB per shard, so 256 MiB is a store of some 200,000 shards.
MANIFEST_MAX_BYTES = 256 << 20
# _pending.json, shard.json and other small JSON files a writer reads back.
SMALL_JSON_MAX_BYTES = 64 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_name(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def outside_problem(fs: Any, root: str, relative: str) -> str | None:
    """On local disk, `relative` must not resolve (through links) to a path outside the store."""
    if not fmt.is_local(fs):
        return None
    real_root = os.path.realpath(root)
    real = os.path.realpath(fmt.join(root, relative))
    if os.path.commonpath([real, real_root]) != real_root:
        return f"{relative}: a link to {real}, outside the store (hostile or damaged store)"
    return None


def kind_problem(fs: Any, root: str, relative: str) -> str | None:
    """A store file must resolve inside the store and be a regular file (no device, FIFO, socket or
    directory); a missing file is not this check's problem (None). Stats, never opens."""
    problem = outside_problem(fs, root, relative)
    if problem or not fmt.is_local(fs):
        return problem
    try:
        mode = os.stat(fmt.join(root, relative)).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        return f"{relative}: {kind_name(mode)}, not a regular file (hostile or damaged store)"
    return None


@contextmanager
def open_regular(fs: Any, root: str, relative: str) -> Iterator[BinaryIO]:
    """Open a store file for reading, refusing (StoreFormatError) one outside the store or not regular.

    On local disk the check is made on the descriptor that is then read, so a file swapped in between
    cannot slip past it, and a FIFO is opened without blocking. Raises FileNotFoundError if it is missing."""
    problem = outside_problem(fs, root, relative)
    if problem:
        raise StoreFormatError(problem)
    path = fmt.join(root, relative)
    if not fmt.is_local(fs):
        with fs.open(path, "rb") as handle:
            yield handle
        return
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise StoreFormatError(f"{relative}: {kind_name(mode)}, not a regular file (hostile or damaged store)")
        handle = os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise
    with handle:
        yield handle


def read_bounded(fs: Any, root: str, relative: str, limit: int) -> bytes:
    """The bytes of a store file of at most `limit` bytes; StoreFormatError if it holds more."""
    with open_regular(fs, root, relative) as handle:
        payload = _read_at_most(handle, limit + 1)
    if len(payload) > limit:
        raise StoreFormatError(f"{relative}: more than {limit:,} bytes, larger than it can be "
                               "(hostile or damaged store)")
    return payload


def _read_at_most(handle: BinaryIO, count: int) -> bytes:
    buffer = io.BytesIO()
    while buffer.tell() < count:
        chunk = handle.read(min(BLOCK_BYTES, count - buffer.tell()))
        if not chunk:
            break
        buffer.write(chunk)
    return buffer.getvalue()


def checksum_bounded(fs: Any, root: str, relative: str, size: int, algorithm: str) -> tuple[str, int]:
    """(hex digest, bytes read) of a store file expected to hold `size` bytes. Reads at most `size` + 1 bytes,
    so a file that is longer, or never ends, costs no more than the one it should be (read > size says so)."""
    digest = new_digest(algorithm)
    read = 0
    with open_regular(fs, root, relative) as handle:
        while read <= size:
            chunk = handle.read(min(BLOCK_BYTES, size + 1 - read))
            if not chunk:
                break
            digest.update(chunk)
            read += len(chunk)
    return digest.hexdigest(), read


def read_json(fs: Any, path: str, limit: int = SMALL_JSON_MAX_BYTES) -> Any:
    """A JSON file the writer reads back (manifest, pending marker, shard.json): a regular file inside the
    store, at most `limit` bytes (StoreFormatError otherwise); None if it does not exist."""
    root, relative = path.rsplit("/", 1)
    try:
        return json.loads(read_bounded(fs, root, relative, limit))
    except FileNotFoundError:
        return None
    except StoreFormatError:  # a ValueError too: not one for the clause below
        raise
    except (ValueError, RecursionError) as error:
        raise StoreFormatError(f"{relative}: not valid JSON ({type(error).__name__})") from None
