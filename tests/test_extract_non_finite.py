"""A target that overflows in float16 gives inf/NaN hidden states for the records that reach the overflow:
the real `beagle-pipeline extract` (local Ray, one forward actor) rejects those records at the source as
`non_finite_states`, with where they are, stores only the finite samples, and exits 0 with the count in its
summary. A shard whose every sample overflows is committed empty, so shard numbering and resume hold.

The target is a real tiny Llama whose embedding row of one byte token, `~`, is 1e5: finite in its float32
file, beyond float16's largest value (65,504), so the float16 forward of every record holding that byte
overflows, as a real target's activations do, and the others' do not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.cli import main
from pipeline.jobkit.target import load_tokenizer
from pipeline.store import committed_shards, open_store, verify_store
from tests.local_ray import local_ray
from tests.tiny import build_target

pytestmark = pytest.mark.slow

OVERFLOW = "~"
# g: finite, o: holds the overflowing byte. Two per shard: shard 1 is all overflow (committed empty).
KINDS = "ggoogog"


@pytest.fixture(scope="module")
def ray_address():
    with local_ray(num_cpus=2) as address:
        yield address


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("overflow")
    target = build_target(root / "target", template="chatml")
    tokenizer = load_tokenizer(str(target))
    (token,) = tokenizer(OVERFLOW)["input_ids"]
    weights = load_file(str(target / "model.safetensors"))
    weights["model.embed_tokens.weight"][token] = 1e5
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    records = [{"id": f"r{i}", "conversations": [
        {"from": "human", "value": f"What is {i} plus {i}?"},
        {"from": "gpt", "value": f"It is {2 * i}." + (f" {OVERFLOW}" if kind == "o" else " Indeed.")}]}
        for i, kind in enumerate(KINDS)]
    for record, kind in zip(records, KINDS):  # the overflow byte is in exactly the records meant to hold it
        text = " ".join(turn["value"] for turn in record["conversations"])
        assert (token in tokenizer(text)["input_ids"]) == (kind == "o")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records) + "not json\n")
    return {"root": root, "target": str(target), "data": str(data)}


def _extract(job, out: Path, *extra: str):
    return CliRunner().invoke(main, ["extract", "--model", job["target"], "--data", job["data"], "--out", str(out),
                                     "--dtype", "float16", "--samples-per-shard", "2", "--max-length", "64",
                                     "--num-workers", "1", "--no-progress", *extra])


@pytest.mark.parametrize("store_dtype", [None, "int8"])  # int8: a non-finite state made the row scale NaN
def test_non_finite_states_are_rejected_at_the_source_and_counted(ray_address, job, store_dtype):
    out = job["root"] / f"store-{store_dtype}"
    result = _extract(job, out, *(["--store-dtype", store_dtype] if store_dtype else []))
    assert result.exit_code == 0, result.output
    good = [f"r{i}" for i, kind in enumerate(KINDS) if kind == "g"]
    bad = [f"r{i}" for i, kind in enumerate(KINDS) if kind == "o"]
    assert f"samples      {len(good)} " in result.output, result.output
    assert "non_finite_states" in result.output and f"rejected     {len(bad) + 1}" in result.output

    report = verify_store(str(out))
    assert report.ok, report.problems
    store = open_store(str(out))
    assert [store[i]["sample_id"] for i in range(len(store))] == good
    assert store.manifest["counts"]["rejected_by_reason"] == {"malformed_json": 1, "non_finite_states": len(bad)}
    assert [shard["samples"] for shard in store.manifest["shards"]] == [2, 0, 1, 1]  # shard 1: all overflowed
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["sample_id"], r["reason"]) for r in rejects if r["reason"] == "non_finite_states"] == \
        [(sample_id, "non_finite_states") for sample_id in bad]
    assert all(r["source"] == job["data"] and r["line"] == r["index"] + 1 for r in rejects)
    assert [r["index"] for r in rejects] == [i for i, kind in enumerate(KINDS) if kind == "o"] + [len(KINDS)]
    assert "float16" in rejects[0]["detail"]

    if store_dtype is not None:
        return
    # Resume: the shards' shard.json keep their rejects, so a rerun that keeps every shard counts the same.
    assert sum(len(info.get("rejects", ())) for info in committed_shards(str(out)).values()) == len(bad)
    (out / "manifest.json").unlink()
    result = _extract(job, out, *(["--store-dtype", store_dtype] if store_dtype else []))
    assert result.exit_code == 0 and "4 kept from an earlier run" in result.output, result.output
    assert [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()] == rejects
    assert verify_store(str(out)).ok
