"""Store operations beyond one writer: merging, remote reads with a local cache, locking, failed writes."""
from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from beagle.torch_store import open_store
from pipeline.store import StoreConflictError, verify_store
from pipeline.store import writer as store_writer
from pipeline.store.merge import merge_stores
from pipeline.store.writer import store_lock
from pipeline.store.hashing import bytes_checksum, checksum_entry
from tests.test_store import CLI, build, make_samples


def test_merge_deduplicates_and_verifies(tmp_path):
    first, second = make_samples(6, torch.bfloat16, seed=1), make_samples(6, torch.bfloat16, seed=2)
    for index, sample in enumerate(second):
        sample["sample_id"] = f"other-{index}"
    second[0]["sample_id"] = first[3]["sample_id"]  # a duplicate: the first store's copy wins
    build(str(tmp_path / "a"), first, "bfloat16")
    build(str(tmp_path / "b"), second, "bfloat16")
    result = subprocess.run([*CLI, "merge", "--no-progress", str(tmp_path / "a"), str(tmp_path / "b"),
                             "--out", str(tmp_path / "m")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "1 duplicate(s) dropped" in result.stdout
    merged = open_store(str(tmp_path / "m"))
    assert len(merged) == 11
    assert verify_store(str(tmp_path / "m")).ok
    by_id = {merged[i]["sample_id"]: merged[i] for i in range(len(merged))}
    assert torch.equal(by_id[first[3]["sample_id"]]["hidden_states"], first[3]["hidden_states"])
    assert torch.equal(by_id["other-5"]["hidden_states"], second[5]["hidden_states"])
    assert merged.manifest["counts"]["tokens"] == sum(len(s["input_ids"]) for s in first + second[1:])


def test_merge_refuses_incompatible_stores_naming_the_field(tmp_path):
    build(str(tmp_path / "a"), make_samples(3, torch.bfloat16), "bfloat16")
    build(str(tmp_path / "b"), make_samples(3, torch.bfloat16), "bfloat16", layers=[-2])
    with pytest.raises(StoreConflictError, match=r"capture\.layers differs"):
        merge_stores([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))


def _flip_a_byte(path) -> None:
    payload = bytearray(path.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    path.write_bytes(bytes(payload))


@pytest.mark.parametrize("damaged", ["hidden", "head"])
def test_merge_refuses_a_damaged_input_naming_the_file(tmp_path, damaged):
    """A merge rehashes what it writes: reading a damaged input unchecked would launder the damage into a
    store that verifies. The input is refused, naming its file, and no complete store appears."""
    first, second = make_samples(6, torch.bfloat16, seed=1), make_samples(6, torch.bfloat16, seed=2)
    for index, sample in enumerate(second):
        sample["sample_id"] = f"other-{index}"
    build(str(tmp_path / "a"), first, "bfloat16")
    build(str(tmp_path / "b"), second, "bfloat16")
    if damaged == "head":
        victim = tmp_path / "a" / "head.safetensors"
    else:
        victim = max((p for p in (tmp_path / "b" / "shards").rglob("*") if p.is_file()
                      and p.name not in ("shard.json", "samples.arrow", "zarr.json")), key=lambda p: p.stat().st_size)
    _flip_a_byte(victim)
    relative = victim.relative_to(victim.parents[0] if damaged == "head" else tmp_path / "b").as_posix()
    with pytest.raises(Exception, match=re.escape(relative)):
        merge_stores([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"))
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_remote_store_reads_through_a_local_cache(tmp_path):
    url = f"memory://{uuid.uuid4().hex}/store"
    samples = make_samples(9, torch.bfloat16)
    build(url, samples, "bfloat16")
    cache = tmp_path / "cache"
    store = open_store(url, cache_dir=str(cache))
    assert torch.equal(store[5]["hidden_states"], samples[5]["hidden_states"])
    assert any(cache.iterdir()), "nothing was cached"
    assert torch.equal(store.load_head()["lm_head"].shape and store[0]["input_ids"], samples[0]["input_ids"])


def test_info_on_a_url_reads_only_the_manifest(tmp_path):
    import fsspec
    url = f"memory://{uuid.uuid4().hex}/store"
    build(url, make_samples(5, torch.float16), "float16")
    fs = fsspec.filesystem("memory")
    for path in fs.find(url.replace("memory://", "/")):
        if "/c/" in path:
            fs.rm(path)  # hidden states gone: info must not need them
    store = open_store(url, check_files=False)
    assert store.manifest["counts"]["samples"] == 5


def test_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path):
    url = str(tmp_path / "s")
    with store_lock(url):
        with pytest.raises(StoreConflictError, match="another process"):
            build(url, make_samples(2, torch.float32), "float32")
    build(url, make_samples(2, torch.float32), "float32")  # free again once released
    assert open_store(url)


def test_lock_is_held_across_processes(tmp_path):
    url = str(tmp_path / "s")
    code = ("import sys,time; from pipeline.store.writer import store_lock\n"
            f"with store_lock({url!r}):\n print('locked', flush=True); time.sleep(30)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreConflictError):
            build(url, make_samples(2, torch.float32), "float32")
    finally:
        holder.kill()
        holder.wait()
    build(url, make_samples(2, torch.float32), "float32")  # the kernel released a killed holder's lock


def test_disk_full_during_a_shard_leaves_no_store_that_looks_complete(tmp_path, monkeypatch):
    url = str(tmp_path / "s")
    real = store_writer.write_raw_files  # a local store's states go through the raw writer
    calls = {"n": 0}

    def failing_write(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(store_writer, "write_raw_files", failing_write)
    with pytest.raises(OSError, match="No space left"):
        build(url, make_samples(10, torch.float32), "float32")
    with pytest.raises(Exception, match="unfinished store"):
        open_store(url)
    assert sorted(store_writer.committed_shards(url)) == [0]
    monkeypatch.setattr(store_writer, "write_raw_files", real)
    build(url, make_samples(10, torch.float32), "float32")  # the same call completes the store
    assert verify_store(url).ok


def _edit_manifest(url, edit) -> None:
    path = Path(url) / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("unlisted", ["samples.arrow", "hidden_states/layer_m1/zarr.json"])
def test_verify_refuses_a_shard_whose_listing_lacks_a_file_it_must_have(tmp_path, unlisted):
    """A file the manifest does not list is never checksummed; a shard must list its sample table and
    every array of its capture, or verify says which is missing."""
    url = str(tmp_path / "s")
    build(url, make_samples(6, torch.bfloat16), "bfloat16")
    _edit_manifest(url, lambda m: m["shards"][0]["files"].pop(f"shards/shard-00000/{unlisted}"))
    report = verify_store(url)
    assert not report.ok
    assert any("shard-00000" in p and unlisted in p and "does not list" in p for p in report.problems), report


def test_verify_checks_rejected_counts_against_the_rejects_file(tmp_path):
    url = str(tmp_path / "s")
    rejects = [{"reason": "too_long", "index": 1}, {"reason": "too_long", "index": 4},
               {"reason": "invalid_json", "index": 7}]
    build(url, make_samples(6, torch.bfloat16), "bfloat16", rejects=rejects)
    assert verify_store(url).ok
    path = Path(url) / "rejects.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))  # one line lost, checksum redone
    payload = path.read_bytes()
    _edit_manifest(url, lambda m: m["files"].update({"rejects.jsonl": checksum_entry(
        "blake3", bytes_checksum(payload), len(payload))}))
    report = verify_store(url)
    assert not report.ok and any("rejects.jsonl: holds" in p for p in report.problems), report


def test_verify_reports_files_no_manifest_lists(tmp_path):
    url = str(tmp_path / "s")
    build(url, make_samples(6, torch.bfloat16), "bfloat16")
    (Path(url) / "shards" / "shard-00001" / "stray.bin").write_bytes(b"x" * 10)
    (Path(url) / "head.safetensors.tmp-1-abc").write_bytes(b"y" * 20)
    report = verify_store(url)
    assert report.ok  # never read: not a problem of the store
    assert report.unlisted == {"head.safetensors.tmp-1-abc": 20, "shards/shard-00001/stray.bin": 10}
    result = subprocess.run([*CLI, "verify", "--no-progress", url], capture_output=True, text=True)
    assert result.returncode == 0 and "NOTE: shards/shard-00001/stray.bin" in result.stderr, result.stderr


def test_verify_notes_manifest_keys_the_format_does_not_define(tmp_path):
    url = str(tmp_path / "s")
    build(url, make_samples(3, torch.bfloat16), "bfloat16")
    assert verify_store(url).unknown_keys == []
    _edit_manifest(url, lambda m: m.update({"comment": "edited by hand"}))
    report = verify_store(url)
    assert report.ok and report.unknown_keys == ["comment"]
    result = subprocess.run([*CLI, "verify", "--no-progress", url], capture_output=True, text=True)
    assert result.returncode == 0 and "NOTE: manifest.json holds keys this format does not define: comment" in \
        result.stderr, result.stderr
