"""A catalog of the feature stores under a folder or an object-store prefix, for teams that share them.

It reads manifests only (one small JSON file per store; never a state, never a checksum pass), so listing a
prefix of many stores costs a directory listing and one read per store. Whatever is found is listed, not
raised: a store being built (`_pending.json`, no manifest), a manifest that does not parse or validate, and
a folder that holds no store at all each get a line saying so.
"""
from __future__ import annotations

import os

import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.store import format as fmt
from pipeline.store.errors import StoreError, StoreNotFoundError
from pipeline.store.hashing import CHECKSUM_ALGORITHMS
from pipeline.store.reader import load_manifest

COMPLETE, UNFINISHED, DAMAGED, NOT_A_STORE = "complete", "unfinished", "damaged", "not a store"


@dataclass
class CatalogEntry:
    """One folder of the catalog. `state` is complete, unfinished, damaged or "not a store"; `problem` says
    why for the last three. The other fields come from a complete store's manifest (None otherwise)."""

    url: str
    state: str
    problem: str | None = None
    dataset_id: str | None = None
    target: str | None = None
    target_weights_sha256: str | None = None
    target_config_sha256: str | None = None
    layers: list[int] | None = None
    dtype: str | None = None
    compression: str | None = None
    samples: int | None = None
    tokens: int | None = None
    bytes: int | None = None
    checksums: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def manifest_facts(manifest: dict) -> dict[str, Any]:
    """What a catalog line says of a complete store, from its manifest alone."""
    entries = [*manifest["files"].values(), *(meta for shard in manifest["shards"] for meta in shard["files"].values())]
    target = manifest.get("target") or {}
    return {
        "dataset_id": manifest["dataset_id"],
        "target": target.get("name"),
        "target_weights_sha256": target.get("weights_sha256"),
        "target_config_sha256": target.get("config_sha256"),
        "layers": list(manifest["layers"]),
        "dtype": manifest["dtype"],
        "compression": (manifest.get("capture") or {}).get("compression", "none"),
        "samples": int(manifest["counts"]["samples"]),
        "tokens": int(manifest["counts"]["tokens"]),
        "bytes": sum(int(s["bytes"]) for s in manifest["shards"]) + sum(int(f["bytes"]) for f in manifest["files"].values()),
        "checksums": sorted({name for meta in entries for name in CHECKSUM_ALGORITHMS if name in meta}),
    }


def _entry(fs: Any, root: str, url: str) -> CatalogEntry | None:
    """The folder `root` as a catalog entry, or None when it shows no sign of being a store."""
    names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
    if fmt.MANIFEST in names:
        try:
            manifest = load_manifest(fs, root, url)
        except StoreError as error:
            return CatalogEntry(url, DAMAGED, problem=str(error).splitlines()[0])
        try:
            return CatalogEntry(url, COMPLETE, **manifest_facts(manifest))
        except (KeyError, TypeError, ValueError) as error:
            return CatalogEntry(url, DAMAGED, problem=f"manifest.json lacks {error}")
    if fmt.PENDING in names or fmt.SHARDS_DIR in names:
        return CatalogEntry(url, UNFINISHED, problem="no manifest.json: a build that has not finished (or died); "
                                                     "rerun the command that started it")
    return None


def list_stores(url: str, *, depth: int = 2) -> list[CatalogEntry]:
    """The stores at `url` and in the folders below it, `depth` levels down at most (0: `url` alone).

    A folder below `url` that is no store and holds none (down to `depth`) is listed as "not a store"
    when it is a direct child of `url`, so that a prefix's contents are all accounted for; deeper ones
    are passed over. Raises StoreNotFoundError only when `url` itself does not exist."""
    if depth < 0:
        raise ValueError(f"depth={depth} must be >= 0")
    fs, root = fmt.open_fs(url)
    if not fs.exists(root) or not fs.isdir(root):
        raise StoreNotFoundError(f"{url} does not exist or is not a folder; pass a local folder or an fsspec "
                                 "URL (s3://bucket/prefix) that holds feature stores")
    base = url.rstrip("/")

    def child_url(path: str) -> str:
        return base + path[len(root.rstrip("/")):]

    local = fmt.is_local(fs)
    seen: set[str] = set()  # real paths walked: a symlink loop, or a second link to a folder, is walked once

    def walk(path: str, level: int) -> list[CatalogEntry]:
        if local:
            real = os.path.realpath(path)
            if real in seen:
                return []
            seen.add(real)
        entry = _entry(fs, path, child_url(path))
        if entry is not None:
            return [entry]
        if level >= depth:
            return []
        found = []
        for child in sorted(fs.ls(path, detail=True), key=lambda info: info["name"]):
            if child.get("type") != "directory":
                continue
            if local and os.path.realpath(child["name"]) in seen:
                continue  # a link back to a folder already walked (a loop): not another folder to list
            below = walk(child["name"].rstrip("/"), level + 1)
            if below or level > 0:
                found += below
            else:
                found.append(CatalogEntry(child_url(child["name"].rstrip("/")), NOT_A_STORE,
                                          problem="no manifest.json, no store below it"))
        return found

    return walk(root, 0)
