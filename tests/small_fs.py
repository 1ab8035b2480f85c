"""A real size-limited filesystem for full-disk tests, shared by the reliability test files."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def mounted_small_tmpfs(where: Path) -> Iterator[Path]:
    """Mount a 64 KiB tmpfs at `where` (created here) for the body of a fixture, then unmount it. Mounting needs
    privileges (root in the CI container); without them the test is skipped with the reason."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); the test needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
