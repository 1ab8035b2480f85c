"""The feature store, format v1: real Arrow and Zarr files on disk and in fsspec's memory filesystem."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pyarrow as pa
import pytest
import torch
import zarr

from beagle.torch_store import open_store
from pipeline.extract.state_encoding import write_shard, write_store
from pipeline.store import (StoreConflictError, StoreError, StoreFormatError, StoreNotFoundError, begin_store,
                            committed_shards, compute_dataset_id, store_identity, verify_store)

HIDDEN, VOCAB = 24, 50
CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]


def make_samples(count: int, dtype: torch.dtype, layers: int = 1, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        length = 3 + (i * 7) % 11
        samples.append({
            "sample_id": f"conv-{i}",
            "input_ids": torch.randint(0, VOCAB, (length,), generator=generator),
            "loss_mask": torch.randint(0, 2, (length,), generator=generator).bool(),
            "hidden_states": (torch.randn(layers, length, HIDDEN, generator=generator) * 30).to(dtype),
        })
    return samples


def build(url: str, samples: list[dict], dtype: str, layers: list[int] = (-1,), **kwargs) -> dict:
    head = {"embed_tokens": torch.randn(VOCAB, HIDDEN), "lm_head": torch.randn(VOCAB, HIDDEN)}
    return write_store(url, samples, head=head, target={"name": "tiny", "architecture": {"vocab_size": VOCAB}},
                       tokenizer={"files_sha256": "x"}, capture={"layers": list(layers), "dtype": dtype,
                                                                 "max_length": 64},
                       source={"files": []}, samples_per_shard=4, **kwargs)


@pytest.fixture(params=["file", "memory"])
def store_url(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    return f"memory://{uuid.uuid4().hex}/store"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(store_url, dtype):
    samples = make_samples(10, dtype)
    build(store_url, samples, str(dtype).split(".")[1])
    store = open_store(store_url)
    assert len(store) == 10
    assert store.lengths.tolist() == [len(s["input_ids"]) for s in samples]
    for index in [7, 0, 9, 3, -1]:  # random access, any order
        got, want = store[index], samples[index]
        assert got["sample_id"] == want["sample_id"]
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert got["hidden_states"].dtype == dtype
        assert torch.equal(got["hidden_states"].view(torch.uint8), want["hidden_states"].view(torch.uint8))
    with pytest.raises(IndexError):
        store[10]


def test_token_reads_leave_the_hidden_states_unopened(store_url):
    """`get_tokens` (token counts for a draft vocabulary) reads the sample table only."""
    samples = make_samples(10, torch.bfloat16)
    build(store_url, samples, "bfloat16")
    store = open_store(store_url)
    for index in [7, 0, -1]:
        ids, mask = store.get_tokens(index)
        assert ids.tolist() == samples[index]["input_ids"].tolist()
        assert mask.astype(bool).tolist() == samples[index]["loss_mask"].tolist()
    assert all("hidden" not in vars(shard) for shard in store._shards)  # cached_property never computed

def test_several_layers_round_trip(tmp_path):
    samples = make_samples(5, torch.bfloat16, layers=3)
    build(str(tmp_path / "s"), samples, "bfloat16", layers=[4, 8, -1])
    store = open_store(str(tmp_path / "s"))
    assert store.layers == [4, 8, -1]
    assert torch.equal(store[2]["hidden_states"], samples[2]["hidden_states"])


def test_local_read_is_a_zero_copy_view_of_the_memory_map(tmp_path):
    build(str(tmp_path / "s"), make_samples(6, torch.bfloat16), "bfloat16")
    store = open_store(str(tmp_path / "s"))
    shard = store._shards[0]
    mapped = shard.hidden[0]
    assert isinstance(mapped, np.memmap)
    hidden = store[1]["hidden_states"]
    base = mapped.ctypes.data
    offset = int(shard.table["token_offset"][1]) * HIDDEN * 2
    assert hidden.data_ptr() == base + offset  # no copy: the tensor points into the mapped file


def test_same_inputs_give_same_id_and_bytes(tmp_path):
    samples = make_samples(9, torch.bfloat16)
    first = build(str(tmp_path / "a"), samples, "bfloat16")
    second = build(str(tmp_path / "b"), samples, "bfloat16")
    assert first["dataset_id"] == second["dataset_id"]
    assert first["shards"] == second["shards"]  # every file's checksum
    assert len(first["files"]["head.safetensors"]["blake3"]) == 64


def test_plain_pyarrow_zarr_and_datasets_read_a_store_without_project_code(tmp_path):
    samples = make_samples(6, torch.bfloat16)
    build(str(tmp_path / "s"), samples, "bfloat16")
    root = tmp_path / "s"
    manifest = json.loads((root / "manifest.json").read_text())
    shard_dir = root / "shards" / manifest["shards"][0]["name"]
    with pa.memory_map(str(shard_dir / "samples.arrow")) as source:
        table = pa.ipc.open_stream(source).read_all()
    row = table.slice(1, 1).to_pylist()[0]
    assert row["input_ids"] == samples[1]["input_ids"].tolist()
    array = zarr.open_array(str(shard_dir / "hidden_states" / "layer_m1"), mode="r")
    assert array.attrs["logical_dtype"] == "bfloat16"
    bits = array[row["token_offset"]:row["token_offset"] + row["length"]]
    states = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bfloat16)
    assert torch.equal(states, samples[1]["hidden_states"][0])
    import datasets
    dataset = datasets.Dataset.from_file(str(shard_dir / "samples.arrow"))
    assert dataset[2]["sample_id"] == samples[2]["sample_id"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing_shard", "edited_manifest", "foreign_shard"])
def test_verify_finds_damage_and_names_the_file(tmp_path, damage):
    root = tmp_path / "s"
    build(str(root), make_samples(10, torch.bfloat16), "bfloat16")
    assert verify_store(str(root)).ok
    target = root / "shards" / "shard-00001" / "hidden_states" / "layer_m1" / "c" / "0" / "0"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[10] ^= 0x01
        target.write_bytes(bytes(data))
        expected = "shard-00001/hidden_states/layer_m1/c/0/0"
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
        expected = "shard-00001/hidden_states/layer_m1/c/0/0"
    elif damage == "missing_shard":
        import shutil
        shutil.rmtree(root / "shards" / "shard-00002")
        expected = "shard-00002"
    elif damage == "edited_manifest":
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["capture"]["max_length"] = 4096
        (root / "manifest.json").write_text(json.dumps(manifest))
        expected = "dataset_id"
    else:
        other = tmp_path / "other"
        build(str(other), make_samples(10, torch.bfloat16, seed=5), "bfloat16")
        import shutil
        shutil.rmtree(root / "shards" / "shard-00000")
        shutil.copytree(other / "shards" / "shard-00000", root / "shards" / "shard-00000")
        expected = "shard-00000"
    report = verify_store(str(root))
    assert not report.ok
    assert any(expected in problem for problem in report.problems), report.problems
    result = subprocess.run([*CLI, "verify", "--no-progress", str(root)], capture_output=True, text=True)
    assert result.returncode == 1 and expected in result.stderr


def test_verify_finds_non_finite_states(tmp_path):
    samples = make_samples(4, torch.float32)
    samples[2]["hidden_states"][0, 1, 3] = float("nan")
    build(str(tmp_path / "s"), samples, "float32")
    report = verify_store(str(tmp_path / "s"))
    assert any("non-finite" in p for p in report.problems), report.problems


def test_unknown_schema_version_is_refused(tmp_path):
    root = tmp_path / "s"
    build(str(root), make_samples(3, torch.float16), "float16")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["schema_version"] = "2.0"
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreFormatError, match="schema_version 2.0"):
        open_store(str(root))


def test_directory_without_manifest_is_not_a_store(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreNotFoundError, match="manifest.json not found"):
        open_store(str(tmp_path / "empty"))
    begin_store(str(tmp_path / "half"), "abc")
    write_shard(str(tmp_path / "half"), 0, make_samples(2, torch.float16), layers=[-1], dtype="float16")
    with pytest.raises(StoreNotFoundError, match="unfinished store"):
        open_store(str(tmp_path / "half"))


def test_missing_file_is_refused_at_open(tmp_path):
    root = tmp_path / "s"
    build(str(root), make_samples(6, torch.float16), "float16")
    os.remove(root / "shards" / "shard-00001" / "samples.arrow")
    with pytest.raises(StoreNotFoundError, match="shard-00001/samples.arrow is missing"):
        open_store(str(root))


@pytest.mark.parametrize("path", ["../outside.bin", "/etc/passwd", "s3://bucket/x", "shards/../../x"])
def test_manifest_paths_leaving_the_store_are_refused(tmp_path, path):
    root = tmp_path / "s"
    build(str(root), make_samples(3, torch.float16), "float16")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][path] = {"sha256": "0", "bytes": 1}
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreFormatError, match="inside the store|leaves the store"):
        open_store(str(root))


def test_begin_store_refuses_other_inputs_and_resumes_same(tmp_path):
    url = str(tmp_path / "s")
    identity = store_identity(target={"a": 1}, tokenizer={}, capture={"layers": [-1]}, source={})
    dataset_id = compute_dataset_id(identity)
    assert begin_store(url, dataset_id) == "new"
    info = write_shard(url, 0, make_samples(2, torch.float32), layers=[-1], dtype="float32")
    assert begin_store(url, dataset_id) == "resume"
    assert committed_shards(url) == {0: info}
    with pytest.raises(StoreConflictError, match="--overwrite"):
        begin_store(url, "another-id")
    assert begin_store(url, "another-id", overwrite=True) == "new"
    assert committed_shards(url) == {}


def test_bad_sample_shapes_are_refused_with_the_sample_named(tmp_path):
    samples = make_samples(2, torch.float32)
    samples[1]["hidden_states"] = samples[1]["hidden_states"][:, :-1]
    with pytest.raises(StoreError, match="conv-1"):
        build(str(tmp_path / "s"), samples, "float32")


def test_info_json_cli(tmp_path):
    root = tmp_path / "s"
    manifest = build(str(root), make_samples(10, torch.bfloat16), "bfloat16")
    result = subprocess.run([*CLI, "info", "--json", str(root)], capture_output=True, text=True, check=True)
    facts = json.loads(result.stdout)
    assert facts["dataset_id"] == manifest["dataset_id"]
    assert facts["num_samples"] == 10 and facts["num_tokens"] == manifest["counts"]["tokens"]
    assert facts["hidden_size"] == HIDDEN and facts["layers"] == [-1] and facts["dtype"] == "bfloat16"
    assert len(facts["shards"]) == 3 and facts["schema_version"] == "1.0"
    plain = subprocess.run([*CLI, "info", str(root)], capture_output=True, text=True, check=True).stdout
    assert "bytes/token" in plain and manifest["dataset_id"] in plain
    missing = subprocess.run([*CLI, "info", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode != 0 and "not a feature store" in missing.stderr


def test_fp8_store_halves_the_bytes_and_stays_close(tmp_path):
    samples = make_samples(12, torch.bfloat16)
    for sample in samples:
        sample["hidden_states"][..., 0] = 59.0  # an outlier dimension, as real states have
    build(str(tmp_path / "bf16"), samples, "bfloat16")
    build(str(tmp_path / "fp8"), samples, "float8_e4m3")
    fp8_store, bf16_store = open_store(str(tmp_path / "fp8")), open_store(str(tmp_path / "bf16"))
    for index in range(len(samples)):
        got, want = fp8_store[index]["hidden_states"], samples[index]["hidden_states"].float()
        assert got.dtype == torch.float32 and got.shape == want.shape
        relative = ((got - want).norm() / want.norm()).item()
        assert relative < 0.04, relative
        assert torch.equal(fp8_store[index]["input_ids"], bf16_store[index]["input_ids"])
    state_bytes = {name: sum(f["bytes"] for s in json.loads((tmp_path / name / "manifest.json").read_text())["shards"]
                             for path, f in s["files"].items() if "hidden_states" in path and "/c/" in path)
                   for name in ("bf16", "fp8")}
    # d=24 here, so the 4-byte per-token scale is a visible share; at d=576 it is under 1%.
    assert state_bytes["fp8"] / state_bytes["bf16"] < (HIDDEN + 4) / (2 * HIDDEN) + 0.02
    assert verify_store(str(tmp_path / "fp8")).ok


def test_tied_embedding_and_lm_head_are_stored(tmp_path):
    shared = torch.randn(VOCAB, HIDDEN)
    write_store(str(tmp_path / "s"), make_samples(2, torch.float32), head={"embed_tokens": shared, "lm_head": shared},
                target={"name": "tied"}, tokenizer={}, capture={"layers": [-1], "dtype": "float32", "max_length": 8},
                source={})
    head = open_store(str(tmp_path / "s")).load_head()
    assert torch.equal(head["embed_tokens"], shared) and torch.equal(head["lm_head"], shared)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3"])
def test_the_local_raw_writer_writes_zarrs_own_bytes(tmp_path, dtype):
    """On a local disk hidden states bypass zarr's encoder (raw chunks, hashed while written); an fsspec
    store goes through zarr. Both must give the same files, byte for byte, and the same checksums."""
    samples = make_samples(9, torch.bfloat16 if dtype != "float32" else torch.float32, layers=2)
    local = build(f"file://{tmp_path}/s", samples, dtype, layers=[3, -1])
    through_zarr = build(f"memory://{uuid.uuid4().hex}/s", samples, dtype, layers=[3, -1])
    assert local["shards"] == through_zarr["shards"]  # names, counts, every file's bytes and sha256
    assert verify_store(str(tmp_path / "s")).ok

