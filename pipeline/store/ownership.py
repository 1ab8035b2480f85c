"""What a store at --out owns: which files are provably ours (the only ones `--overwrite` deletes), and
reopening a complete store whose files no longer match its manifest.

A folder at --out may hold anything: a web app's `manifest.json`, someone's notes inside a shard folder.
`--overwrite` deletes only a store this project wrote (a manifest this version reads, or a pending marker
of ours) and of it only the files its manifest and its shards' `shard.json` list, the few top-level files
an unfinished store writes before its manifest, and our own temporaries; anything else is refused.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from pipeline.store import atomic
from pipeline.store import files
from pipeline.store import format as fmt
from pipeline.store.errors import StoreConflictError, StoreFormatError

log = logging.getLogger(__name__)


def reopen_if_damaged(url: str, fs: Any, root: str, manifest: dict, command: str) -> bool:
    """A complete store of the same inputs is kept only if every file it lists still has its recorded size
    and checksum (one read of the whole store, at hashing speed). Else it is made unfinished again, so the
    build redoes what is damaged: the pending marker first, then the damaged shards and top-level files
    are deleted, the manifest last (a crash in between leaves a manifest that the next run checks again).
    Returns whether it was reopened."""
    from pipeline.store.integrity import file_problem

    damaged_shards, damaged_files = [], []
    for relative, meta in sorted(manifest["files"].items()):
        problem, _ = file_problem(fs, root, relative, meta)
        if problem:
            damaged_files.append((relative, problem))
    for shard in manifest["shards"]:
        for relative, meta in sorted(shard["files"].items()):
            problem, _ = file_problem(fs, root, relative, meta)
            if problem:
                damaged_shards.append((shard["name"], problem))
                break
    if not damaged_shards and not damaged_files:
        return False
    log.warning("%s is complete but damaged (%s); redoing what is damaged", url,
                "; ".join(problem for _, problem in damaged_files + damaged_shards))
    atomic.write_bytes(fmt.join(root, fmt.PENDING),
                       fmt.canonical_json({"dataset_id": manifest["dataset_id"], "command": command}), fs=fs)
    for relative, _ in damaged_files:
        remove(fs, fmt.join(root, relative))
    for name, _ in damaged_shards:
        remove(fs, fmt.join(root, fmt.SHARDS_DIR, name))
    remove(fs, fmt.join(root, fmt.MANIFEST))
    return True


def remove(fs: Any, path: str) -> None:
    """Delete a file or a folder (recursively), if there; on local disk a link is removed, never followed."""
    if not fmt.is_local(fs):
        if fs.exists(path):
            fs.rm(path, recursive=True)
    elif os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


_PENDING_KEYS = {"dataset_id", "command"}


def check_ours(url: str, manifest: Any, pending: Any) -> None:
    """A manifest or pending marker at `url` must be one this project writes; else StoreConflictError: the
    folder holds something else (a web app's manifest.json, say), which is never called a store, nor deleted."""
    from pipeline.store.reader import _check_paths, check_manifest

    if manifest is not None:
        try:
            _check_paths(check_manifest(manifest, url), url)
        except StoreFormatError as error:
            raise StoreConflictError(f"{url} holds a {fmt.MANIFEST} that is not a beagle-pipeline store's ({error}); "
                                     "nothing was deleted: move it away, or choose another --out") from None
    elif not (isinstance(pending, dict) and set(pending) <= _PENDING_KEYS
              and isinstance(pending.get("dataset_id"), str) and pending["dataset_id"]):
        raise StoreConflictError(f"{url} holds a {fmt.PENDING} that is not a beagle-pipeline store's; "
                                 "nothing was deleted: move it away, or choose another --out")


# What an unfinished store holds besides its shards: written before the manifest, under these names.
_UNFINISHED_TOP_LEVEL = (fmt.PENDING, fmt.HEAD, fmt.REJECTS)
# Files of a shard on object storage that crashed before its shard.json (local shards build in a temporary).
_SHARD_LAYOUT = (fmt.SAMPLES_FILE, "hidden_states/")


def owned_paths(fs: Any, root: str, manifest: dict | None) -> set[str]:
    """The files (relative paths) that are provably this store's: those its manifest lists, the manifest
    and the shards' shard.json; for an unfinished store, the files each committed shard's shard.json
    lists and the few top-level files written before the manifest. Temporaries are matched by name."""
    owned = set(_UNFINISHED_TOP_LEVEL)
    if manifest is not None:
        from pipeline.store.integrity import listed_files

        owned |= {fmt.MANIFEST, *listed_files(manifest)}
        owned |= {f"{fmt.SHARDS_DIR}/{shard['name']}/{fmt.SHARD_INFO}" for shard in manifest["shards"]}
    shards_dir = fmt.join(root, fmt.SHARDS_DIR)
    if fs.exists(shards_dir) and fs.isdir(shards_dir):
        for entry in fs.ls(shards_dir, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if not (name.startswith("shard-") and name[len("shard-"):].isdigit()):
                continue
            prefix = f"{fmt.SHARDS_DIR}/{name}/"
            try:
                info = files.read_json(fs, fmt.join(entry, fmt.SHARD_INFO))
            except StoreFormatError:
                info = None
            if isinstance(info, dict) and isinstance(info.get("files"), dict):
                owned.add(prefix + fmt.SHARD_INFO)
                owned |= {relative for relative in info["files"] if isinstance(relative, str)
                          and relative.startswith(prefix)}
            elif not fmt.is_local(fs) and not fs.exists(fmt.join(entry, fmt.SHARD_INFO)):
                owned |= {relative for relative in _relative_files(fs, root, prefix)
                          if relative[len(prefix):].startswith(_SHARD_LAYOUT)}
    return owned


def foreign_files(fs: Any, root: str, owned: set[str]) -> list[str]:
    """The files under `root` that are neither `owned`, nor the lock, nor our temporaries: in the way."""
    return [relative for relative in _relative_files(fs, root) if relative not in owned
            and relative not in (fmt.LOCK, fmt.LOCK_OBJECT) and not is_temporary(relative)]


def is_temporary(relative: str) -> bool:
    """This project's temporaries: `NAME.tmp-*` of atomic writes at the top level or in shards/, shard
    build folders `shards/.shard-N.tmp-*/...` and replaced shards `shards/.shard-N.old-*/...`."""
    parts = relative.split("/")
    if len(parts) == 1:
        return ".tmp-" in parts[0]
    if parts[0] != fmt.SHARDS_DIR:
        return False
    return ".tmp-" in parts[1] or (parts[1].startswith(".shard-") and ".old-" in parts[1])


def _relative_files(fs: Any, root: str, prefix: str = "") -> list[str]:
    """Every file under `root` (or under its sub-folder `prefix`), relative to root, sorted. Links are
    listed as files, never followed."""
    base = fmt.join(root, prefix.rstrip("/")) if prefix else root
    if not fs.exists(base):
        return []
    if fmt.is_local(fs):
        found = []
        for folder, directories, names in os.walk(base):
            found += [os.path.relpath(os.path.join(folder, name), root) for name in names]
            found += [os.path.relpath(os.path.join(folder, name), root) for name in directories
                      if os.path.islink(os.path.join(folder, name))]
        return sorted(path.replace(os.sep, "/") for path in found)
    return sorted(path[len(root.rstrip("/")) + 1:] for path in fs.find(base))


def delete_owned(fs: Any, root: str, owned: set[str]) -> None:
    """Delete the store's own files and temporaries, then the folders left empty (never the lock)."""
    for relative in _relative_files(fs, root):
        if relative in owned or is_temporary(relative):
            remove(fs, fmt.join(root, relative))
    if fmt.is_local(fs):
        for folder, _, _ in sorted(os.walk(fmt.join(root, fmt.SHARDS_DIR)), key=lambda entry: -len(entry[0])):
            if not os.listdir(folder) and not os.path.islink(folder):
                os.rmdir(folder)
