"""Stored states come back typed as what they are (ml_dtypes.bfloat16, float8_e4m3fn codes), as zero-copy
views; the files stay plain zarr, and every array the writer produced reads back bit for bit through
`zarr.open_array` (so a zarr release that changes the sharded layout we write by hand is caught here)."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import zarr

from beagle.store_tensors import open_store as open_tensor_store
from pipeline.store import open_store
from pipeline.store.fp8 import decode
from tests.test_store import build, make_samples

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@pytest.mark.parametrize("logical", sorted(DTYPES))
def test_states_are_typed_views_whose_values_convert(tmp_path, logical):
    samples = make_samples(7, DTYPES[logical], layers=2)
    build(str(tmp_path / "s"), samples, logical, layers=[-2, -1])
    store = open_store(str(tmp_path / "s"))
    want_dtype = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
                  "float32": np.dtype(np.float32)}[logical]
    for index, sample in enumerate(samples):
        hidden = store[index]["hidden_states"]  # [2, L, d]
        assert hidden.dtype == want_dtype
        # values, not bit patterns: what a user of `.astype` expects
        assert np.array_equal(hidden.astype(np.float32), sample["hidden_states"].float().numpy())


def test_a_bf16_sample_is_a_view_of_the_memory_map_and_so_is_its_tensor(tmp_path):
    build(str(tmp_path / "s"), make_samples(5, torch.bfloat16), "bfloat16")
    store = open_store(str(tmp_path / "s"))
    mapped = store._shards[0].hidden[0]  # the shard file's memory map, [tokens, d] uint16
    assert isinstance(mapped, np.memmap)
    for index in range(3):
        layers = store.get_numpy(index)["hidden_states"]
        assert layers[0].dtype == ml_dtypes.bfloat16 and np.shares_memory(layers[0], mapped)
        assert np.shares_memory(store[index]["hidden_states"], mapped)
    tensors = open_tensor_store(str(tmp_path / "s"))
    tensor = tensors[1]["hidden_states"]
    assert tensor.dtype == torch.bfloat16
    own_map = tensors.store._shards[0].hidden[0]
    start = own_map.__array_interface__["data"][0]
    assert start <= tensor.data_ptr() < start + own_map.nbytes  # inside the file's map: no copy


def test_fp8_codes_are_float8_e4m3fn_and_decode_as_the_store_does(tmp_path):
    build(str(tmp_path / "s"), make_samples(6, torch.float32), "float8_e4m3")
    store = open_store(str(tmp_path / "s"))
    for index in range(len(store)):
        raw = store.get_numpy(index, decode=False)
        codes, scales = raw["hidden_states"][0], raw["hidden_scales"][0]
        assert codes.dtype == ml_dtypes.float8_e4m3fn
        ours = decode(codes, scales)
        theirs = codes.astype(np.float32) * scales[:, None]  # ml_dtypes' own conversion
        assert np.array_equal(np.isnan(ours), np.isnan(theirs))
        assert np.array_equal(ours[~np.isnan(ours)], theirs[~np.isnan(theirs)])
        assert np.array_equal(store[index]["hidden_states"][0], ours)
    tensor_codes = open_tensor_store(str(tmp_path / "s"))[0]["hidden_states"]
    assert tensor_codes.dtype == torch.float32  # decoded by default, as before


def _arrays(root: Path) -> list[tuple[Path, str]]:
    """(shard directory, array path inside it) of every zarr array the writer produced."""
    found = []
    for meta in sorted(root.glob("shards/*/hidden_states/*/zarr.json")):
        found.append((meta.parent.parent.parent, str(meta.parent.relative_to(meta.parent.parent.parent))))
    return found


@pytest.mark.parametrize("logical, compression", [("bfloat16", None), ("bfloat16", "zstd"), ("float16", None),
                                                  ("float32", None), ("float8_e4m3", None),
                                                  ("float8_e4m3", "zstd")])
def test_every_array_reads_back_bit_for_bit_through_plain_zarr(tmp_path, logical, compression):
    root = tmp_path / "s"
    samples = make_samples(9, DTYPES.get(logical, torch.float32), layers=2)
    build(str(root), samples, logical, layers=[3, -1], compression=compression)
    store = open_store(str(root))
    arrays = _arrays(root)
    assert len(arrays) == 2 * len(store.manifest["shards"]) * (2 if logical == "float8_e4m3" else 1)
    starts = np.cumsum([0] + [s["samples"] for s in store.manifest["shards"]])
    for shard_index, shard in enumerate(store.manifest["shards"]):
        directory = root / "shards" / shard["name"]
        for layer_index, layer in enumerate(store.layers):
            name = f"hidden_states/layer_{layer}".replace("layer_-", "layer_m")
            plain = zarr.open_array(store=str(directory), path=name, mode="r")
            attributes = json.loads((directory / name / "zarr.json").read_text())
            assert attributes["attributes"]["logical_dtype"] == logical
            whole = np.asarray(plain[:])
            offset = 0
            for row in range(starts[shard_index], starts[shard_index + 1]):
                ours = store.get_numpy(int(row), decode=False)["hidden_states"][layer_index]
                theirs = whole[offset:offset + len(ours)]
                assert np.array_equal(np.ascontiguousarray(ours).view(np.uint8),
                                      np.ascontiguousarray(theirs).view(np.uint8))
                offset += len(ours)
            assert offset == shard["tokens"]
            if logical == "float8_e4m3":
                scales = zarr.open_array(store=str(directory), path=name + "_scale", mode="r")[:]
                assert scales.dtype == np.float32 and len(scales) == shard["tokens"]


def test_the_writer_takes_ml_dtypes_arrays_as_it_takes_their_bits(tmp_path):
    samples = make_samples(5, torch.bfloat16)
    typed = [{**s, "hidden_states": s["hidden_states"].view(torch.uint16).numpy().view(ml_dtypes.bfloat16)}
             for s in samples]
    bits = [{**s, "hidden_states": s["hidden_states"].view(torch.uint16).numpy()} for s in samples]
    first = build(str(tmp_path / "a"), typed, "bfloat16")
    second = build(str(tmp_path / "b"), bits, "bfloat16")
    assert first["shards"] == second["shards"]  # the same bytes, checksum for checksum


@pytest.mark.parametrize("section", ["Reading without beagle-pipeline", "Checksums"])
def test_the_python_snippets_of_docs_store_format_run_on_a_real_store(tmp_path, section):
    """docs/store-format.md shows plain-library code (pyarrow, zarr, ml_dtypes, blake3): it must run."""
    import re

    build(str(tmp_path / "s"), make_samples(5, torch.bfloat16), "bfloat16")
    doc = (Path(__file__).resolve().parent.parent / "docs" / "store-format.md").read_text()
    body = doc.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", body, re.S).group(1)
    assert 'root = "STORE"' in code
    namespace: dict = {}
    exec(code.replace('root = "STORE"', f'root = {str(tmp_path / "s")!r}'), namespace)  # noqa: S102
    if section.startswith("Reading"):
        assert namespace["hidden"].dtype == ml_dtypes.bfloat16 and namespace["as_torch"].dtype == torch.bfloat16
