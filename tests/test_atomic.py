"""pipeline.store.atomic: the one write-then-rename helper, always with fsync of the file and its folder."""
from __future__ import annotations

import os
import uuid

import fsspec
import pytest

from pipeline.store import atomic


@pytest.fixture
def fsyncs(monkeypatch) -> list[str]:
    """Records what each os.fsync call synced: "file" or "dir"."""
    seen: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        seen.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", recording)
    return seen


def test_write_replaces_whole_and_syncs_file_then_folder(tmp_path, fsyncs):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    atomic.write_text(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert fsyncs == ["file", "dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_text("old")

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        atomic.write_bytes(path, b"new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_object_store_paths_are_put_in_one_request():
    fs = fsspec.filesystem("memory")
    path = f"/{uuid.uuid4().hex}/head.safetensors"
    atomic.write_bytes(path, b"\x00\x01", fs=fs)
    assert fs.cat_file(path) == b"\x00\x01"


def test_commit_directory_swaps_or_keeps(tmp_path, fsyncs):
    final = tmp_path / "step-00000002"
    for content, replace, committed, kept in [("first", True, True, "first"), ("second", True, True, "second"),
                                              ("third", False, False, "second")]:
        staging = tmp_path / f".staging-{content}"
        (staging / "sub").mkdir(parents=True)
        (staging / "sub" / "state.json").write_text(content)
        fsyncs.clear()
        assert atomic.commit_directory(staging, final, replace=replace) is committed
        assert (final / "sub" / "state.json").read_text() == kept
        assert not staging.exists()
        assert fsyncs.count("file") == 1 and fsyncs[-1] == "dir"  # the file, its folders, then the parent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]  # nothing moved aside is left
