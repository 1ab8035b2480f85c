"""Hidden states come out of the numpy reader in their real dtypes (ml_dtypes.bfloat16, float8_e4m3fn codes),
as zero-copy views of bytes that plain zarr reads back bit for bit."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import zarr
import zarr.storage

import beagle.torch_store as torch_store
from pipeline.extract.state_encoding import encode_codes, fp8_encode, head_payload
from pipeline.store import StoreFormatError, open_store, write_store
from pipeline.store import format as fmt
from pipeline.store import fp8
from pipeline.store.merge import merge_stores
from tests.test_store import HIDDEN, build, make_samples

HEAD = head_payload(embed_tokens=torch.zeros(50, HIDDEN), lm_head=torch.zeros(50, HIDDEN))
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8_e4m3": torch.bfloat16, "int8": torch.bfloat16}  # lossy stores are encoded from bf16
TYPED = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
         "float32": np.dtype(np.float32), "float8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "int8": np.dtype(np.int8)}


def _store(tmp_path: Path, dtype: str, *, compression: str | None = None, layers=(-1,)) -> tuple[str, list[dict]]:
    samples = make_samples(9, TORCH_DTYPES[dtype], layers=len(layers))
    url = str(tmp_path / f"{dtype}-{compression}")
    build(url, samples, dtype, layers=list(layers), compression=compression)
    return url, samples


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_states_are_typed_zero_copy_views_with_the_right_values(tmp_path, dtype):
    url, samples = _store(tmp_path, dtype)
    store = open_store(url)
    for index in [0, 5, 8]:
        hidden = store[index]["hidden_states"]  # [1, L, d]
        assert hidden.dtype == TYPED[dtype]
        np.testing.assert_array_equal(hidden.astype(np.float32), samples[index]["hidden_states"].float().numpy())
    shard = store._shards[1]
    mapped = shard.hidden[0]  # the storage-typed memory map of the shard file
    assert isinstance(mapped, np.memmap)
    hidden = store[4]["hidden_states"]  # sample 0 of shard 1 (4 samples per shard)
    assert np.shares_memory(hidden, mapped)
    hidden[0, 0, 0] = TYPED[dtype].type(1.5)  # copy-on-write map: the file is untouched, the view is shared
    assert mapped[int(shard.table["token_offset"][0]), :1].view(TYPED[dtype])[0] == 1.5


def test_torch_reads_stay_zero_copy_and_bit_exact(tmp_path):
    url, samples = _store(tmp_path, "bfloat16")
    store = torch_store.open_store(url)
    shard = store.store._shards[0]
    hidden = store[1]["hidden_states"]
    assert hidden.dtype == torch.bfloat16 and torch.equal(hidden, samples[1]["hidden_states"])
    offset = int(shard.table["token_offset"][1]) * HIDDEN * 2
    assert hidden.data_ptr() == shard.hidden[0].ctypes.data + offset
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    as_torch = torch_store.as_tensor(codes)
    assert as_torch.dtype == torch.float8_e4m3fn and as_torch.data_ptr() == codes.ctypes.data


def test_fp8_codes_are_typed_and_dequantize_as_the_project_does(tmp_path):
    url, samples = _store(tmp_path, "float8_e4m3")
    store = open_store(url)
    for index in [0, 5, 8]:
        raw = store.get_numpy(index, decode=False)
        codes, scales = raw["hidden_states"][0], raw["hidden_scales"][0]  # [L, d] e4m3fn, [L] float32
        want_codes, want_scales = fp8_encode(samples[index]["hidden_states"][0])
        assert codes.dtype == TYPED["float8_e4m3"]
        np.testing.assert_array_equal(codes.view(np.uint8), want_codes)  # the bytes torch wrote, bit for bit
        np.testing.assert_array_equal(scales, want_scales)
        dequantized = codes.astype(np.float32) * scales[:, None]
        np.testing.assert_array_equal(dequantized, store[index]["hidden_states"][0])
        np.testing.assert_array_equal(dequantized, fp8.decode(want_codes, want_scales))
    assert np.shares_memory(store.get_numpy(1, decode=False)["hidden_states"][0], store._shards[0].hidden[0])
    every_code = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(every_code.view(ml_dtypes.float8_e4m3fn).astype(np.float32), fp8.DECODE_TABLE)
    np.testing.assert_array_equal(torch.from_numpy(every_code).view(torch.float8_e4m3fn).float().numpy(),
                                  fp8.DECODE_TABLE)


def _zarr_arrays(shard_dir: Path) -> list[str]:
    """Every array under a shard directory, by its zarr path."""
    found = []
    for metadata in sorted(shard_dir.rglob("zarr.json")):
        if json.loads(metadata.read_text())["node_type"] == "array":
            found.append(metadata.parent.relative_to(shard_dir).as_posix())
    return found


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3", "int8"])
def test_plain_zarr_reads_every_array_bit_for_bit(tmp_path, dtype, compression):
    """The raw shard file is written by hand (pipeline/store/zarr_io.py): a zarr release that lays sharded
    arrays out differently must fail here, not for a user reading the store with plain zarr."""
    layers = (2, -1)
    url, samples = _store(tmp_path, dtype, compression=compression, layers=layers)
    store = open_store(url)
    lossy = dtype in fmt.LOSSY_DTYPES
    for shard in store._shards:
        shard_dir = Path(shard.directory)
        names = [fmt.hidden_array_name(layer) for layer in layers]
        names += [fmt.scale_array_name(layer) for layer in layers] if lossy else []
        assert _zarr_arrays(shard_dir) == sorted(names)
        assert all(isinstance(array, np.memmap) != bool(compression) for array in shard.hidden)
        zstore = zarr.storage.LocalStore(str(shard_dir), read_only=True)
        first = store._starts[shard.info["index"]]
        rows = [store.get_numpy(first + row, decode=False) for row in range(shard.info["samples"])]
        for position, layer in enumerate(layers):
            plain = zarr.open_array(store=zstore, path=fmt.hidden_array_name(layer), mode="r")
            assert plain.attrs["logical_dtype"] == dtype and plain.dtype == fmt.storage_dtype(dtype)
            ours = np.concatenate([row["hidden_states"][position] for row in rows])
            assert ours.dtype == TYPED[dtype] and ours.shape == plain.shape
            assert plain[:].view(np.uint8).tobytes() == ours.view(np.uint8).tobytes()
            if lossy:
                plain_scales = zarr.open_array(store=zstore, path=fmt.scale_array_name(layer), mode="r")
                ours_scales = np.concatenate([row["hidden_scales"][position] for row in rows])
                assert plain_scales[:].view(np.uint8).tobytes() == ours_scales.view(np.uint8).tobytes()
        for row, sample in zip(rows, samples[first:first + shard.info["samples"]]):  # and both are the input
            want = encode_codes(sample["hidden_states"], dtype)[0] if lossy \
                else sample["hidden_states"].contiguous().view(torch.uint8).numpy()
            assert np.stack(row["hidden_states"]).view(np.uint8).tobytes() == want.tobytes()


def test_stores_written_as_storage_bits_are_unchanged_and_open_typed(tmp_path):
    """Old stores: the bytes on disk did not change (bf16 is still its uint16 bit pattern in a plain
    uint16 zarr array), so a store written from uint16 bits, the only input older writers took, is
    file for file the store written from ml_dtypes arrays, and opens typed."""
    samples = make_samples(6, torch.bfloat16)
    common = dict(head=HEAD, target={"name": "tiny"}, tokenizer={}, source={}, samples_per_shard=4,
                  capture={"layers": [-1], "dtype": "bfloat16", "max_length": 64})
    as_bits = [{**s, "input_ids": s["input_ids"].numpy(), "loss_mask": s["loss_mask"].numpy(),
                "hidden_states": s["hidden_states"].view(torch.uint16).numpy()} for s in samples]
    typed = [{**s, "hidden_states": s["hidden_states"].view(ml_dtypes.bfloat16)} for s in as_bits]
    old = write_store(str(tmp_path / "old"), as_bits, **common)
    new = write_store(str(tmp_path / "new"), typed, **common)
    assert old["shards"] == new["shards"]  # every file, by checksum
    metadata = json.loads((tmp_path / "old" / "shards" / "shard-00000" / "hidden_states" / "layer_m1"
                           / "zarr.json").read_text())
    assert metadata["data_type"] == "uint16"
    assert metadata["attributes"]["encoding"] == "uint16 bit pattern of bfloat16"
    store = open_store(str(tmp_path / "old"))
    assert store[3]["hidden_states"].dtype == TYPED["bfloat16"]
    np.testing.assert_array_equal(store[3]["hidden_states"].view(np.uint16), as_bits[3]["hidden_states"])


def test_the_writer_refuses_values_that_are_not_bf16_bits(tmp_path):
    samples = [{**s, "hidden_states": s["hidden_states"].numpy()} for s in make_samples(2, torch.float32)]
    with pytest.raises(StoreFormatError, match="ml_dtypes.bfloat16 or their uint16 bit pattern"):
        write_store(str(tmp_path / "s"), samples, head=HEAD, target={}, tokenizer={}, source={},
                    capture={"layers": [-1], "dtype": "bfloat16", "max_length": 64})
    assert fmt.to_storage_array(np.zeros(3, ml_dtypes.bfloat16), "bfloat16").dtype == np.uint16


def test_merge_copies_typed_fp8_codes_unchanged(tmp_path):
    first, second = (str(tmp_path / name) for name in ("a", "b"))
    build(first, make_samples(5, torch.bfloat16, seed=1), "float8_e4m3")
    others = [{**s, "sample_id": f"other-{s['sample_id']}"} for s in make_samples(5, torch.bfloat16, seed=2)]
    build(second, others, "float8_e4m3")
    merge_stores([first, second], str(tmp_path / "m"), samples_per_shard=3)
    merged = open_store(str(tmp_path / "m"))
    assert len(merged) == 10
    inputs = [open_store(first), open_store(second)]
    for index in range(len(merged)):
        got = merged.get_numpy(index, decode=False)
        source = inputs[index // 5].get_numpy(index % 5, decode=False)
        assert got["hidden_states"][0].view(np.uint8).tobytes() == source["hidden_states"][0].view(np.uint8).tobytes()
        np.testing.assert_array_equal(got["hidden_scales"][0], source["hidden_scales"][0])


def test_the_writer_takes_ml_dtypes_arrays_as_it_takes_their_bits(tmp_path):
    samples = make_samples(5, torch.bfloat16)
    typed = [{**s, "hidden_states": s["hidden_states"].view(torch.uint16).numpy().view(ml_dtypes.bfloat16)}
             for s in samples]
    bits = [{**s, "hidden_states": s["hidden_states"].view(torch.uint16).numpy()} for s in samples]
    first = build(str(tmp_path / "a"), typed, "bfloat16")
    second = build(str(tmp_path / "b"), bits, "bfloat16")
    assert first["shards"] == second["shards"]  # the same bytes, checksum for checksum


def test_a_typed_bf16_array_written_to_a_float32_store_keeps_its_values():
    """Values, not bits: reading a bf16 store and writing its samples into a float32 one must convert."""
    from pipeline.store.format import to_storage_array

    typed = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    assert to_storage_array(typed, "float32").tolist() == [1.5, -2.0, 3.25]
    assert to_storage_array(typed, "bfloat16").dtype == np.uint16


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
