"""The small encodings: int8 codes with a per-token scale, and zstd over any dtype (pipeline/store/quantized.py,
format.StoreEncoding). Lossless codecs give back the same bytes; int8 rounds each value to within half a step
of its token's absmax / 127."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.extract.state_encoding import encode_codes
from pipeline.store import StoreFormatError, open_store, verify_store
from pipeline.store import format as fmt
from tests.test_store import build, make_samples


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_int8_states_are_within_half_a_step_and_verify(tmp_path, compression):
    samples = make_samples(9, torch.float32, layers=2)
    url = str(tmp_path / "s")
    build(url, samples, "int8", layers=[3, -1], compression=compression)
    assert verify_store(url).ok
    store = open_store(url)
    for index, sample in enumerate(samples):
        want = sample["hidden_states"].numpy()  # [2, L, d]
        got = store[index]["hidden_states"]
        step = np.abs(want).max(axis=-1, keepdims=True) / 127
        assert got.dtype == np.float32 and np.all(np.abs(got - want) <= step / 2 + 1e-6)
        raw = store.get_numpy(index, decode=False)
        codes, _ = encode_codes(sample["hidden_states"], "int8")
        assert raw["hidden_states"][0].dtype == np.int8 and np.array_equal(np.stack(raw["hidden_states"]), codes)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3", "int8"])
def test_zstd_gives_back_the_same_bytes_in_smaller_files(tmp_path, dtype):
    samples = make_samples(12, torch.bfloat16, layers=1)
    for sample in samples:  # low-entropy states, so that zstd has something to find
        sample["hidden_states"] = (sample["hidden_states"] / 16).round() * 16
    build(str(tmp_path / "raw"), samples, dtype)
    build(str(tmp_path / "zstd"), samples, dtype, compression="zstd")
    raw, packed = open_store(str(tmp_path / "raw")), open_store(str(tmp_path / "zstd"))
    for index in range(len(samples)):
        a = raw.get_numpy(index, decode=False)["hidden_states"][0]
        b = packed.get_numpy(index, decode=False)["hidden_states"][0]
        assert a.dtype == b.dtype and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()
    size = lambda root: sum(f.stat().st_size for f in root.glob("shards/*/hidden_states/layer_m1/c/*/*"))  # noqa: E731
    assert size(tmp_path / "zstd") < size(tmp_path / "raw")


def test_codes_of_the_wrong_kind_are_refused_not_cast():
    with pytest.raises(StoreFormatError, match="int8 hidden states must be int8 codes"):
        fmt.storage_view(np.zeros((2, 4), np.float32), "int8")
    with pytest.raises(StoreFormatError, match="float8_e4m3"):
        fmt.storage_view(np.zeros((2, 4), np.int8), "float8_e4m3")
    with pytest.raises(StoreFormatError, match="compression 'lz4'"):
        fmt.StoreEncoding("int8", "lz4")
    with pytest.raises(StoreFormatError, match="unsupported hidden-state dtype"):
        fmt.StoreEncoding("int4")
    with pytest.raises(StoreFormatError, match="not a lossy store dtype"):
        encode_codes(torch.zeros(2, 4), "bfloat16")


def test_extract_refuses_a_lossless_store_dtype_other_than_the_models(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main
    from tests.tiny import build_target

    target = build_target(tmp_path / "t", template="chatml")
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    bad = CliRunner().invoke(main, ["extract", "--model", str(target), "--data", str(data), "--out",
                                    str(tmp_path / "o"), "--compression", "lz4", "--no-progress"])
    assert bad.exit_code == 2 and "lz4" in bad.output
    dry = CliRunner().invoke(main, ["extract", "--model", str(target), "--data", str(data), "--out",
                                    str(tmp_path / "o"), "--store-dtype", "int8", "--compression", "zstd",
                                    "--dry-run", "--no-progress"])
    assert dry.exit_code == 0, dry.output
    narrowed = CliRunner().invoke(main, ["extract", "--model", str(target), "--data", str(data), "--out",
                                         str(tmp_path / "o"), "--dtype", "float32", "--store-dtype", "bfloat16",
                                         "--dry-run", "--no-progress"])
    assert narrowed.exit_code == 0, narrowed.output
    from_half = CliRunner().invoke(main, ["extract", "--model", str(target), "--data", str(data), "--out",
                                        str(tmp_path / "o"), "--dtype", "float16", "--store-dtype", "bfloat16",
                                        "--dry-run", "--no-progress"])
    assert from_half.exit_code == 2 and "--store-dtype bfloat16: with --dtype float16" in from_half.output


def test_verify_finds_a_non_finite_scale_of_an_int8_store(tmp_path):
    """One NaN in a token's states makes its int8 scale NaN and the whole row decode as NaN, while its codes
    look fine: verify used to call such a store sound (a bf16 store of the same data was flagged)."""
    samples = make_samples(4, torch.float32, layers=2)
    samples[1]["hidden_states"][0, 3, 5] = float("nan")
    url = str(tmp_path / "int8")
    build(url, samples, "int8", layers=[3, -1])
    report = verify_store(url)
    assert not report.ok and any("1 non-finite scales" in problem for problem in report.problems), report.problems
    assert np.isnan(open_store(url)[1]["hidden_states"][0, 3]).all()  # the whole row, as the docstring says


def test_info_says_an_int8_store_is_lossy(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    samples = make_samples(2, torch.float32, layers=1)
    for dtype in ("int8", "float32"):
        build(str(tmp_path / dtype), samples, dtype, layers=[-1])
    lossy = CliRunner().invoke(main, ["info", str(tmp_path / "int8")]).output
    exact = CliRunner().invoke(main, ["info", str(tmp_path / "float32")]).output
    assert "int8 (lossy" in lossy and "lossy" not in exact
