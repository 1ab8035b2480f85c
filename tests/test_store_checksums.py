"""File checksums of the store: BLAKE3 for new stores, sha256 stores still read, mixed merges, and entries
that name no algorithm, two, or an unknown one are refused (pipeline/store/hashing.py)."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

from beagle.torch_store import open_store
from pipeline.store import StoreError, StoreFormatError, verify_store
from pipeline.store.hashing import entry_checksum
from pipeline.store.merge import merge_stores
from tests.test_store import build, make_samples


def _all_entries(root: Path) -> dict[str, dict]:
    manifest = json.loads((root / "manifest.json").read_text())
    entries = dict(manifest["files"])
    for shard in manifest["shards"]:
        entries.update(shard["files"])
    return entries


def _as_sha256_store(root: Path) -> None:
    """Rewrite a store's entries as a writer of before 2026-12-02 recorded them: `{"sha256", "bytes"}`, in
    every shard.json and in the manifest (the identity, and so the dataset_id, does not involve them)."""
    def convert(files: dict) -> dict:
        return {path: {"sha256": hashlib.sha256((root / path).read_bytes()).hexdigest(), "bytes": meta["bytes"]}
                for path, meta in files.items()}

    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"] = convert(manifest["files"])
    for shard in manifest["shards"]:
        shard["files"] = convert(shard["files"])
        info_path = root / "shards" / shard["name"] / "shard.json"
        info = json.loads(info_path.read_text())
        info["files"] = shard["files"]
        info_path.write_text(json.dumps(info))
    (root / "manifest.json").write_text(json.dumps(manifest))


def _flip_a_state_byte(root: Path) -> str:
    relative = "shards/shard-00001/hidden_states/layer_m1/c/0/0"
    path = root / relative
    payload = bytearray(path.read_bytes())
    payload[5] ^= 0x01
    path.write_bytes(bytes(payload))
    return relative


def test_a_new_store_records_blake3_of_each_file_as_written(tmp_path):
    root = tmp_path / "store"
    build(str(root), make_samples(9, torch.bfloat16), "bfloat16")
    entries = _all_entries(root)
    assert entries and all(set(meta) == {"blake3", "bytes"} for meta in entries.values())
    for path, meta in entries.items():
        payload = (root / path).read_bytes()
        assert meta["bytes"] == len(payload)
        assert meta["blake3"] == blake3.blake3(payload).hexdigest(), path
    assert not verify_store(str(root)).problems


@pytest.mark.skipif(shutil.which("b3sum") is None, reason="the b3sum tool is not installed (apt install b3sum)")
def test_b3sum_checks_a_store_file_as_docs_store_format_says(tmp_path):
    root = tmp_path / "store"
    build(str(root), make_samples(5, torch.bfloat16), "bfloat16")
    for path, meta in _all_entries(root).items():
        out = subprocess.run(["b3sum", str(root / path)], capture_output=True, text=True, check=True).stdout
        assert out.split()[0] == meta["blake3"], path


def test_a_sha256_store_of_before_opens_verifies_and_catches_damage(tmp_path):
    root = tmp_path / "old"
    samples = make_samples(9, torch.bfloat16)
    build(str(root), samples, "bfloat16")
    _as_sha256_store(root)
    assert all(entry_checksum(meta)[0] == "sha256" for meta in _all_entries(root).values())
    assert not verify_store(str(root)).problems
    store = open_store(str(root), verify="first-read")
    for index, sample in enumerate(samples):
        assert torch.equal(store[index]["hidden_states"][0], sample["hidden_states"][0])
    relative = _flip_a_state_byte(root)
    assert any(f"{relative}: sha256 mismatch" in problem for problem in verify_store(str(root)).problems)
    damaged = open_store(str(root), verify="first-read")
    with pytest.raises(StoreError, match=f"{relative}: sha256 mismatch"):
        for index in range(len(damaged)):
            damaged[index]


def test_merging_a_sha256_store_with_a_blake3_store_gives_a_blake3_store_that_verifies(tmp_path):
    old, new, out = tmp_path / "old", tmp_path / "new", tmp_path / "merged"
    first, second = make_samples(6, torch.bfloat16, seed=1), make_samples(5, torch.bfloat16, seed=2)
    for sample in second:
        sample["sample_id"] = "other-" + sample["sample_id"]  # merge keeps one sample per id
    build(str(old), first, "bfloat16")
    build(str(new), second, "bfloat16")
    _as_sha256_store(old)
    merge_stores([str(old), str(new)], str(out), samples_per_shard=4)
    assert all(entry_checksum(meta)[0] == "blake3" for meta in _all_entries(out).values())
    assert not verify_store(str(out)).problems
    merged = open_store(str(out))
    assert len(merged) == 11
    got = [merged[i]["hidden_states"][0].view(torch.int16).numpy() for i in range(11)]
    want = [s["hidden_states"][0].view(torch.int16).numpy() for s in first + second]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_merge_input_damaged_under_sha256_is_refused(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    build(str(old), make_samples(6, torch.bfloat16, seed=1), "bfloat16")
    build(str(new), make_samples(5, torch.bfloat16, seed=2), "bfloat16")
    _as_sha256_store(old)
    relative = _flip_a_state_byte(old)
    with pytest.raises(StoreError, match=f"{relative}: sha256 mismatch"):
        merge_stores([str(old), str(new)], str(tmp_path / "merged"), samples_per_shard=4)


@pytest.mark.parametrize("change", ["none", "both", "unknown", "not_a_string"])
def test_an_entry_that_does_not_name_one_known_checksum_is_refused_naming_the_file(tmp_path, change):
    root = tmp_path / "store"
    build(str(root), make_samples(5, torch.bfloat16), "bfloat16")
    manifest = json.loads((root / "manifest.json").read_text())
    path = next(iter(manifest["shards"][0]["files"]))
    meta = manifest["shards"][0]["files"][path]
    digest = meta.pop("blake3")
    if change == "both":
        meta.update(blake3=digest, sha256=hashlib.sha256((root / path).read_bytes()).hexdigest())
    elif change == "unknown":
        meta["md5"] = hashlib.md5((root / path).read_bytes()).hexdigest()
    elif change == "not_a_string":
        meta["blake3"] = 7
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreFormatError):
        open_store(str(root))
    assert verify_store(str(root)).problems
