"""Checksums of store files: which algorithm, how an entry names it, and streaming digests.

A store lists each file as `{"bytes": n, ALGORITHM: hexdigest}`, with exactly one algorithm key. New
stores use BLAKE3: cryptographic like sha256, so a digest still proves content, but ~5 GB/s on one core
here against sha256's ~1.2, which capped the writer at a third of a raw write (docs/benchmarks.md, P8).
Stores written with sha256 keep their entries and verify as before; a merged store may hold both.
Identity fingerprints (dataset_id, model and input hashes) are small or recorded elsewhere and stay sha256.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import blake3

from pipeline.store.errors import StoreFormatError

BLOCK_BYTES = 8 << 20
BLAKE3 = "blake3"
SHA256 = "sha256"
CHECKSUM_ALGORITHMS = (BLAKE3, SHA256)
DEFAULT_CHECKSUM = BLAKE3


def new_digest(algorithm: str = DEFAULT_CHECKSUM) -> Any:
    """A fresh hashlib-style digest (`update`, `hexdigest`) for `algorithm`. blake3's `update` releases the
    GIL on large buffers, as hashlib's does, so a writer can hash in one thread while it writes in another."""
    if algorithm == BLAKE3:
        return blake3.blake3()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise StoreFormatError(f"unknown checksum algorithm {algorithm!r}; this reader knows "
                           f"{', '.join(CHECKSUM_ALGORITHMS)} (a newer beagle-pipeline may know more)")


def checksum_entry(algorithm: str, digest: str, size: int) -> dict[str, Any]:
    """A file's entry in shard.json and the manifest: `{"bytes": size, algorithm: digest}`."""
    return {algorithm: digest, "bytes": int(size)}


def entry_checksum(meta: Mapping[str, Any], *, where: str = "manifest") -> tuple[str, str]:
    """(algorithm, hex digest) of a file entry: exactly one known algorithm key with a string value."""
    found = [(name, meta[name]) for name in CHECKSUM_ALGORITHMS if name in meta]
    if len(found) != 1 or not isinstance(found[0][1], str):
        raise StoreFormatError(f"{where}: a file entry needs exactly one checksum ({' or '.join(CHECKSUM_ALGORITHMS)}) "
                               f"as a hex string, found {sorted(k for k in meta if k != 'bytes')}; the manifest "
                               "is corrupt, or written by a newer beagle-pipeline")
    return found[0]


def has_valid_checksum(meta: Any) -> bool:
    """Whether `meta` is a dict with exactly one known checksum (for structure checks that collect problems)."""
    try:
        entry_checksum(meta)
    except (StoreFormatError, TypeError):
        return False
    return True


def update_from_stream(digest: Any, stream: BinaryIO, block_bytes: int = BLOCK_BYTES) -> Any:
    """Feed a binary stream into `digest` block by block (never the whole file in memory)."""
    while chunk := stream.read(block_bytes):
        digest.update(chunk)
    return digest


def update_from_file(digest: Any, path: str | Path) -> Any:
    with open(path, "rb") as stream:
        return update_from_stream(digest, stream)


def sha256_local_file(path: str | Path) -> str:
    """Hex sha256 of a local file (model weights and input fingerprints)."""
    return update_from_file(hashlib.sha256(), path).hexdigest()


def bytes_checksum(payload: bytes, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """Hex digest of bytes already in memory."""
    digest = new_digest(algorithm)
    digest.update(payload)
    return digest.hexdigest()
