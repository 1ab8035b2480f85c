"""Streaming sha256 over files, the one routine behind every checksum and fingerprint we record."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, BinaryIO

BLOCK_BYTES = 8 << 20


def update_from_stream(digest: Any, stream: BinaryIO, block_bytes: int = BLOCK_BYTES) -> Any:
    """Feed a binary stream into `digest` block by block (never the whole file in memory)."""
    while chunk := stream.read(block_bytes):
        digest.update(chunk)
    return digest


def update_from_file(digest: Any, path: str | Path) -> Any:
    with open(path, "rb") as stream:
        return update_from_stream(digest, stream)


def sha256_local_file(path: str | Path) -> str:
    """Hex sha256 of a local file."""
    return update_from_file(hashlib.sha256(), path).hexdigest()
