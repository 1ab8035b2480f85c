"""One writer per store on object storage: a lock object with a lease, created by a conditional write.

Object stores have no flock. A job claims a store by creating `STORE/_lock.json` only if it does not
exist (S3's `If-None-Match: *`, fsspec's `mode="create"`); the object names the job and the time its
lease ends. The holder renews the lease while it works and deletes the object when it is done. A job that
dies leaves the object behind: once its lease has run out, the next job may take the store over; before
that it is refused with the time it can retry. Two jobs never write shards into one store at once, and a
refused job deletes nothing.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.store.format import LOCK_OBJECT

log = logging.getLogger(__name__)

LEASE_SECONDS = 600.0      # a dead job's claim lasts this long after its last renewal
RENEW_SECONDS = 60.0


def _create_exclusively(fs: Any, path: str, payload: bytes) -> bool:
    """Write `path` only if no object is there; False if one is (someone else holds the store)."""
    try:
        fs.pipe_file(path, payload, mode="create")
    except FileExistsError:
        return False
    except OSError as error:  # botocore's PreconditionFailed arrives wrapped in an OSError by s3fs
        if "PreconditionFailed" in str(error) or "412" in str(error) or "At least one of the pre" in str(error):
            return False
        raise
    return True


def _read(fs: Any, path: str) -> dict | None:
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}  # unreadable: treated as an expired claim


@contextmanager
def object_store_lock(fs: Any, root: str, url: str, busy: Callable[[str], Exception], *,
                      lease_seconds: float = LEASE_SECONDS, renew_seconds: float = RENEW_SECONDS) -> Iterator[None]:
    """Hold the store at `root` (on `fs`) for the block; raise `busy(reason)` if another live job holds it."""
    path = f"{root.rstrip('/')}/{LOCK_OBJECT}"
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"

    def claim() -> bytes:
        return json.dumps({"owner": owner, "expires": time.time() + lease_seconds}).encode()

    if not _create_exclusively(fs, path, claim()):
        held = _read(fs, path)
        expires = float((held or {}).get("expires", 0.0))
        if held is not None and expires > time.time():
            raise busy(f"{url} is being written by another job ({held.get('owner')}, lock object {path}, lease "
                       f"until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(expires))}); wait for it to "
                       f"finish, or if that job is dead, retry after its lease ends or delete {path}")
        log.warning("taking over %s: the lock of %s expired", url, (held or {}).get("owner"))
        fs.rm_file(path)
        if not _create_exclusively(fs, path, claim()):
            raise busy(f"{url}: another job took over its expired lock ({path}) at the same moment")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(renew_seconds):
            held = _read(fs, path)
            if not held or held.get("owner") != owner:
                log.error("lost the lock on %s to %s", url, (held or {}).get("owner"))
                return
            fs.pipe_file(path, claim())

    renewer = threading.Thread(target=renew, name="store-lock-lease", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        held = _read(fs, path)
        if held and held.get("owner") == owner:
            fs.rm_file(path)
