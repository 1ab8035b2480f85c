"""`extract --engine vllm` (vLLM's CPU build in .venv-vllm, a worker process per forward actor) against `--engine hf`.

The slow test extracts the same conversations with both engines through the real job on a local Ray, in fp32,
from a tiny Llama vLLM's CPU attention takes (tests/tiny_engine.py, head_dim 64): the token ids and loss masks
are equal, the states of every captured layer (a middle one and -1, after the final norm) agree within fp32
rounding, the head is the same bytes, and the manifest names the engine. The two stores have different ids, so
a rerun with the other engine into a store is refused instead of mixing shards of both. Measured 2026-12-04 on
2 cores: worst relative difference 9e-7; the vLLM run ~100 s, most of it vLLM's start.
The fast tests check the one-line refusals, which need no vLLM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.tiny import build_target
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target") / "target", template="chatml_generation")


@pytest.fixture()
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "Hello"},
                                                  {"from": "gpt", "value": "Hi there!"}]}) + "\n")
    return path


def _invoke(*args: str):
    return CliRunner().invoke(main, ["extract", *args])


def test_vllm_options_need_the_vllm_engine(tiny_target, chats, tmp_path):
    common = ["--model", str(tiny_target), "--data", str(chats), "--out", str(tmp_path / "store"), "--dry-run"]
    result = _invoke(*common, "--tensor-parallel-size", "2")
    assert result.exit_code == 1 and "add --engine vllm" in result.output, result.output
    result = _invoke(*common, "--engine", "vllm", "--device-map", "auto")
    assert result.exit_code == 1 and "--device-map is the transformers engine's" in result.output, result.output
    result = _invoke(*common, "--engine", "vllm", "--num-gpus-per-worker", "2")
    assert result.exit_code == 1 and "--tensor-parallel-size x --pipeline-parallel-size" in result.output
    result = _invoke(*common, "--engine", "vllm")  # --max-length 2048 on a target of 512 positions
    assert result.exit_code == 1 and "give at most 511" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    result = _invoke(*common, "--engine", "vllm", "--max-length", "511")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "store").exists()


def test_a_missing_vllm_environment_is_one_line_and_writes_no_store(tiny_target, chats, tmp_path):
    out = tmp_path / "store"
    result = _invoke("--model", str(tiny_target), "--data", str(chats), "--out", str(out), "--no-progress",
                     "--engine", "vllm", "--vllm-python", str(tmp_path / "no-venv" / "bin" / "python"),
                     "--max-length", "100")
    assert result.exit_code == 1, result.output
    assert "no vLLM environment at" in result.output and "make serve-venv" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (out / "manifest.json").exists() and not (out / "shards").exists()


def test_scratch_folders_left_by_dead_actors_are_removed_and_nothing_else(tmp_path):
    from pipeline.extract.vllm_forward import make_scratch

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"beagle-vllm-states-{gone.pid}-abc"  # a dead actor's: only the worker's own files
    stale.mkdir()
    (stale / "req-1.safetensors").write_bytes(b"x")
    (stale / "req-2.safetensors.lock").write_bytes(b"")
    foreign = tmp_path / f"beagle-vllm-states-{gone.pid}-def"  # a file the worker never writes: not provably ours
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    living = tmp_path / f"beagle-vllm-states-{os.getpid()}-ghi"  # a running actor's
    living.mkdir()
    (living / "req-3.safetensors").write_bytes(b"x")
    unnamed = tmp_path / "beagle-vllm-states-xyz"
    unnamed.mkdir()

    made = make_scratch(str(tmp_path))
    assert made.name.startswith(f"beagle-vllm-states-{os.getpid()}-") and made.is_dir()
    assert not stale.exists() and foreign.exists() and living.exists() and unnamed.exists()


@pytest.mark.slow
def test_vllm_states_equal_the_transformers_engines_within_fp32_rounding(tmp_path):
    require_vllm()
    from pipeline.extract.pipeline import ExtractConfig, run_extract
    from pipeline.extract.vllm_forward import scratch_root
    from pipeline.store.reader import open_store
    from tests.local_ray import local_ray
    from tests.tiny_engine import SENTENCES, build_engine_target, one_thread

    scratch_before = set(Path(scratch_root()).glob("beagle-vllm-states-*"))
    with one_thread():
        build_engine_target(tmp_path / "target")
    records = [{"id": f"s{k}", "conversations": [{"from": "human", "value": sentence},
                                                 {"from": "gpt", "value": SENTENCES[(k + 1) % len(SENTENCES)]}]}
               for k, sentence in enumerate(SENTENCES)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records) + "{broken\n")
    stores = {engine: tmp_path / f"store-{engine}" for engine in ("hf", "vllm")}

    def config(engine: str, out: Path, **changes) -> ExtractConfig:
        return ExtractConfig(model_path=str(tmp_path / "target"), data=(str(data),), out=str(out), dtype="float32",
                             layers=(1, -1), max_length=256, samples_per_shard=4, num_workers=1, engine=engine,
                             **changes)

    with local_ray(num_cpus=2):
        summaries = {engine: run_extract(config(engine, out)) for engine, out in stores.items()}
        # the other engine into a finished store is refused, not resumed with shards of both
        with pytest.raises(Exception, match="overwrite"):
            run_extract(config("hf", stores["vllm"]))

    assert summaries["vllm"].samples == summaries["hf"].samples == len(SENTENCES)
    assert summaries["vllm"].tokens == summaries["hf"].tokens and summaries["vllm"].shards == 2
    read = {engine: open_store(str(out)) for engine, out in stores.items()}
    assert read["vllm"].layers == read["hf"].layers == [1, -1]
    assert read["vllm"].dataset_id != read["hf"].dataset_id
    worst = 0.0
    for index in range(len(read["hf"])):
        ours, theirs = read["hf"].get_numpy(index), read["vllm"].get_numpy(index)
        assert ours["sample_id"] == theirs["sample_id"]
        np.testing.assert_array_equal(ours["input_ids"], theirs["input_ids"])
        np.testing.assert_array_equal(ours["loss_mask"], theirs["loss_mask"])
        for hf_state, vllm_state in zip(ours["hidden_states"], theirs["hidden_states"], strict=True):
            hf_state, vllm_state = np.asarray(hf_state, np.float64), np.asarray(vllm_state, np.float64)  # [L, d]
            assert hf_state.shape == vllm_state.shape
            worst = max(worst, float(np.abs(hf_state - vllm_state).max() / np.abs(hf_state).max()))
    assert worst < 1e-5, worst  # fp32 rounding of other kernels; a wrong layer would be off by O(1)
    assert (stores["vllm"] / "head.safetensors").read_bytes() == (stores["hf"] / "head.safetensors").read_bytes()
    manifests = {engine: json.loads((out / "manifest.json").read_text()) for engine, out in stores.items()}
    made_by = manifests["vllm"]["extra"]["extract"]["engine"]
    assert made_by["name"] == "vllm" and made_by["version"] == "0.32.0" and made_by["tensor_parallel_size"] == 1
    assert manifests["vllm"]["capture"]["engine"] == {"name": "vllm", "version": "0.32.0"}
    assert "engine" not in manifests["hf"]["capture"]
    assert manifests["hf"]["extra"]["extract"]["engine"]["name"] == "hf"
    assert manifests["vllm"]["counts"] == manifests["hf"]["counts"]
    assert manifests["vllm"]["counts"]["rejected_by_reason"] == {"malformed_json": 1}
    assert (stores["vllm"] / "rejects.jsonl").read_text() == (stores["hf"] / "rejects.jsonl").read_text()
    assert not set(Path(scratch_root()).glob("beagle-vllm-states-*")) - scratch_before  # the workers cleaned up
