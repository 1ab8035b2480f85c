"""Extraction end to end on a real local Ray: stored states, masks, rejects, determinism, resume after SIGKILL.

One Ray session serves the module (starting Ray costs ~3 s and ~1 GiB); the killed CLI run starts its own.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from beagle.layer_capture import default_capture_layers
from pipeline.extract.chat import tokenize_record
from pipeline.jobkit.target import load_tokenizer
from pipeline.extract.inputs import Record
from pipeline.extract.pipeline import ExtractConfig, run_extract
from beagle.torch_store import open_store
from pipeline.store import StoreConflictError, committed_shards, verify_store
from pipeline.store.hashing import entry_checksum
from tests.local_ray import local_ray
from tests.tiny import build_target

pytestmark = pytest.mark.slow

GOOD_CHATS = [{"id": f"c{i}", "conversations": [
    {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
    {"from": "gpt", "value": f"The answer is {2 * i}." + " Indeed." * (i % 4)},
    {"from": "human", "value": "Thank you!"}, {"from": "gpt", "value": "You are welcome."}]} for i in range(9)]
BAD_LINES = ['{"conversations": [', '"just a string"', '{"title": "x"}',
             '{"conversations": [{"from": "human", "value": null}, {"from": "gpt", "value": "y"}]}',
             '{"conversations": [{"from": "function", "value": "x"}]}', '{"conversations": []}', '{"text": ""}',
             '{"conversations": [{"from": "human", "value": "no reply"}]}', '{"id": "c0", "text": "duplicate"}',
             json.dumps({"conversations": [{"from": "human", "value": "long " * 80}, {"from": "gpt", "value": "ok"}]})]
BAD_REASONS = ["malformed_json", "not_an_object", "missing_field", "missing_field", "unknown_role",
               "empty_conversation", "empty_text", "no_assistant_turn", "duplicate_id", "no_loss_tokens"]


@pytest.fixture(scope="module")
def ray_address():
    with local_ray(num_cpus=4) as address:
        yield address


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    target = build_target(root / "target", template="chatml")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in GOOD_CHATS[:6]) + "\n".join(BAD_LINES) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"id": c["id"], "messages": [
        {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
        for t in c["conversations"]]} for c in GOOD_CHATS[6:]]), root / "more.parquet")
    (root / "plain.json").write_text(json.dumps([{"text": "The quick brown fox jumps over the lazy dog."},
                                                 {"text": "Hello, how are you today?"}]))
    return {"root": root, "target": target,
            "data": (str(chats), str(root / "more.parquet"), str(root / "plain.json"))}


def _config(workspace, out, **overrides):
    settings = dict(model_path=str(workspace["target"]), data=workspace["data"], out=str(out), dtype="float32",
                    max_length=64, samples_per_shard=3, batch_tokens=128, tokenize_chunk=4, num_workers=2)
    settings.update(overrides)
    return ExtractConfig(**settings)


def _shard_checksums(url):
    return {rel: entry_checksum(meta) for shard in open_store(url).manifest["shards"] for rel, meta in shard["files"].items()}


def test_two_workers_store_what_a_direct_forward_computes(ray_address, workspace):
    out = workspace["root"] / "store"
    summary = run_extract(_config(workspace, out))
    assert summary.samples == 11 and summary.shards == 4 and summary.actors == 2
    assert open_store(str(out)).layers == default_capture_layers(2) == [1, -1]  # no --layers: every form's
    assert summary.rejected_by_reason == dict(Counter(BAD_REASONS))
    assert verify_store(str(out)).ok
    store = open_store(str(out))
    assert store.manifest["counts"]["rejected_by_reason"] == dict(Counter(BAD_REASONS))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == BAD_REASONS
    assert [r["line"] for r in rejects] == list(range(7, 7 + len(BAD_LINES)))
    ids = [f"c{i}" for i in range(9)] + ["plain.json:0", "plain.json:1"]
    assert [store[i]["sample_id"] for i in range(len(store))] == ids

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(workspace["target"]), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(workspace["target"]))
    records = [Record(f"c{i}", "", 0, messages=tuple(
        ({"human": "user", "gpt": "assistant"}[t["from"]], t["value"]) for t in c["conversations"]))
        for i, c in enumerate(GOOD_CHATS)] + [Record("p", "", 0, text=t) for t in
                                              ("The quick brown fox jumps over the lazy dog.", "Hello, how are you today?")]
    with torch.no_grad():
        for i, record in enumerate(records):
            sample, expected = store[i], tokenize_record(tokenizer, record, max_length=64)
            assert sample["input_ids"].tolist() == expected.input_ids.tolist()
            assert sample["loss_mask"].tolist() == expected.loss_mask.tolist()
            direct = model(torch.as_tensor(expected.input_ids, dtype=torch.long)[None], output_hidden_states=True)
            for position, layer in enumerate(store.layers):  # HF hidden_states indices, -1 after the final norm
                torch.testing.assert_close(sample["hidden_states"][position], direct.hidden_states[layer][0],
                                           atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(store.load_head()["embed_tokens"], model.get_input_embeddings().weight)


def test_a_default_store_trains_every_form_we_ship(ray_address, workspace, tmp_path):
    """`extract` with no --layers keeps what the paper form (-1), the engine form (`--residual state`) and
    EAGLE-3's three-layer recipe need: each trains on it without a second pass of the target (issue 36)."""
    from beagle.train_config import TrainConfig
    from beagle.trainer import train
    store = workspace["root"] / "store"
    if not (store / "manifest.json").exists():
        run_extract(_config(workspace, store))
    fast = dict(batch_tokens=128, lr=3e-3, warmup_steps=1, window_size=2, simulation_steps=2, checkpoint_every=100,
                vocab_chunk=128, stage1_epochs=1, stage2_epochs=1, max_steps=2, bf16=False)
    for name, settings, keys in [("paper", {}, [-1]), ("engine", {"residual": "state"}, [1])]:
        run = tmp_path / name
        train([str(store)], run, TrainConfig(**fast, **settings))
        assert json.loads((run / "drafter" / "config.json").read_text())["key_layers"] == keys, name


def test_an_int8_zstd_store_holds_the_float32_store_s_states_rounded(ray_address, workspace):
    """--store-dtype int8 --compression zstd: the same samples as the float32 store of the test above, each
    token's states within int8's rounding (half a step of its absmax / 127), in files about a third the
    size; the encoding is part of the identity, so the two stores have other dataset_ids."""
    exact = workspace["root"] / "store"
    if not (exact / "manifest.json").exists():
        run_extract(_config(workspace, exact))
    out = workspace["root"] / "store-int8"
    summary = run_extract(_config(workspace, out, store_dtype="int8", compression="zstd"))
    assert summary.samples == 11 and verify_store(str(out)).ok
    small, full = open_store(str(out)), open_store(str(exact))
    assert small.manifest["dtype"] == "int8" and small.manifest["capture"]["compression"] == "zstd"
    assert small.manifest["target"]["dtype"] == "float32" and small.dataset_id != full.dataset_id
    for i in range(len(full)):
        want, got = full[i]["hidden_states"], small[i]["hidden_states"]  # [1, L, d] float32 both
        step = want.abs().amax(dim=-1, keepdim=True) / 127
        assert got.dtype == torch.float32 and bool(((got - want).abs() <= step / 2 + 1e-6).all())
    layer_bytes = lambda root: sum(f.stat().st_size for f in root.glob("shards/*/hidden_states/layer_m1/c/*/*"))  # noqa: E731
    assert layer_bytes(out) < 0.4 * layer_bytes(exact)


def test_a_bf16_store_from_a_float32_target_holds_its_states_rounded_once(ray_address, workspace):
    """--dtype float32 --store-dtype bfloat16, the fast extract on a CPU that emulates bf16: the float32
    store's states each rounded to nearest bf16 (bit for bit what torch's cast gives), half the bytes; the
    manifest says both dtypes, and the encoding is part of the identity."""
    exact = workspace["root"] / "store"
    if not (exact / "manifest.json").exists():
        run_extract(_config(workspace, exact))
    out = workspace["root"] / "store-bf16"
    summary = run_extract(_config(workspace, out, store_dtype="bfloat16"))
    assert summary.samples == 11 and verify_store(str(out)).ok
    half, full = open_store(str(out)), open_store(str(exact))
    assert half.manifest["dtype"] == "bfloat16" and half.manifest["target"]["dtype"] == "float32"
    assert half.dataset_id != full.dataset_id
    for i in range(len(full)):
        want = full[i]["hidden_states"].to(torch.bfloat16)  # [1, L, d]
        got = half[i]["hidden_states"]
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    files = lambda root: list(root.glob("shards/*/hidden_states/layer_m1/c/*/*"))  # noqa: E731
    # Each file is one zarr shard: its values, then an index of 16 bytes per inner chunk plus a crc32c (20 here).
    values = lambda root: sum(f.stat().st_size - 20 for f in files(root))  # noqa: E731
    assert len(files(out)) == len(files(exact)) and 2 * values(out) == values(exact)


def test_a_head_lost_after_every_shard_committed_is_read_from_the_weight_files(ray_address, workspace, tmp_path,
                                                                                 monkeypatch):
    """The crash between the last shard and the head: the rerun writes the head from two tensors of the
    safetensors files, without loading the target on the driver, byte for byte what the actors wrote."""
    import shutil

    first = workspace["root"] / "store"
    if not (first / "manifest.json").exists():
        run_extract(_config(workspace, first))
    out = tmp_path / "store"
    shutil.copytree(first, out)
    head = (out / "head.safetensors").read_bytes()
    for name in ("head.safetensors", "manifest.json"):
        (out / name).unlink()
    from pipeline.extract import forward

    def no_target_on_the_driver(*args, **kwargs):
        raise AssertionError("the driver loaded the whole target to write the head")
    monkeypatch.setattr(forward.TargetForward, "__init__", no_target_on_the_driver)  # this process only
    summary = run_extract(_config(workspace, out))
    assert summary.samples == 11 and verify_store(str(out)).ok
    assert (out / "head.safetensors").read_bytes() == head


def test_an_actor_forwards_the_next_shard_while_it_writes_the_last(ray_address, workspace):
    """Two shards in flight per actor, the forward under a lock: writes overlap the next forward."""
    out = workspace["root"] / "overlapped"
    summary = run_extract(_config(workspace, out, num_workers=1, samples_per_shard=2))
    assert summary.shards == 6 and summary.actors == 1 and verify_store(str(out)).ok
    assert summary.write_overlap_seconds > 0
    assert summary.actor_forward_seconds < summary.actor_seconds


def test_write_overlap_is_measured_per_actor():
    from pipeline.extract.dispatch import write_overlap_seconds

    spans = [(1, 0.0, 1.0, 3.0), (1, 1.0, 2.5, 4.0), (2, 0.0, 1.0, 2.0), (1, 2.5, 3.0, 5.0)]
    # actor 1: shard 1 written over [1, 3] while shard 2 forwards over [1, 2.5] -> 1.5; shard 2 written over
    # [2.5, 4] while shard 3 forwards over [2.5, 3] -> 0.5; actor 2 alone -> 0
    assert write_overlap_seconds(spans) == pytest.approx(2.0)
    from pipeline.extract.dispatch import actor_busy_seconds
    assert actor_busy_seconds(spans) == pytest.approx((5.0 - 0.0) + (2.0 - 0.0))  # actor 1 [0, 5], actor 2 [0, 2]


def test_reruns_are_deterministic_and_other_settings_are_refused(ray_address, workspace):
    first, second = workspace["root"] / "store", workspace["root"] / "again"
    if not (first / "manifest.json").exists():
        run_extract(_config(workspace, first))
    summary = run_extract(_config(workspace, second, num_workers=1, tokenize_chunk=512))
    assert summary.dataset_id == open_store(str(first)).dataset_id
    assert _shard_checksums(str(second)) == _shard_checksums(str(first))
    assert run_extract(_config(workspace, first)).state == "complete"
    with pytest.raises(StoreConflictError, match="built from other inputs or settings.*--overwrite"):
        run_extract(_config(workspace, first, max_length=32))


def _cli(*args):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    return [str(Path(sys.executable).with_name("beagle-pipeline")), "extract", *args], env


def _actor_pids():
    """Pids of live forward actors (Ray titles them after the class)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"ShardExtractor" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_resume_after_sigkill_of_the_driver_and_of_an_actor(ray_address, workspace, tmp_path):
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps({"id": f"m{i}", "conversations": [
        {"from": "human", "value": f"Tell me about {i} " * (1 + i % 5)},
        {"from": "gpt", "value": f"Here is what I know about {i}. " * (1 + i % 7)}]}) + "\n" for i in range(120)))
    out = tmp_path / "store"
    args = ["--model", str(workspace["target"]), "--data", str(data), "--out", str(out), "--dtype", "float32",
            "--samples-per-shard", "1", "--max-length", "256", "--no-progress"]
    command, env = _cli(*args)
    driver = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(committed_shards(str(out))) < 3 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert driver.poll() is None, driver.stdout.read().decode()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)  # the local Ray it started, if anything outlived it
        except ProcessLookupError:
            pass
    kept = committed_shards(str(out))
    assert 3 <= len(kept) < 120, f"the kill came too late to test resume ({len(kept)} shards committed)"
    assert not (out / "manifest.json").exists()

    # Resume, joining the test's Ray, and SIGKILL a forward actor mid-way: Ray restarts it and redoes its shard.
    command, env = _cli(*args, "--address", ray_address)
    resumed = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, killed = time.monotonic() + 120, []
    while not killed and resumed.poll() is None and time.monotonic() < deadline:
        if len(committed_shards(str(out))) >= len(kept) + 2:
            killed = _actor_pids()
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr[-2000:]
    assert killed, "the resumed run finished before an actor could be killed"
    reused = re.search(r"\((\d+) kept from an earlier run", stdout)
    assert reused and len(kept) <= int(reused.group(1)) < 120, stdout

    reference = tmp_path / "reference"
    config = ExtractConfig(model_path=str(workspace["target"]), data=(str(data),), out=str(reference),
                           dtype="float32", samples_per_shard=1, max_length=256)
    assert run_extract(config).dataset_id == open_store(str(out)).dataset_id
    assert _shard_checksums(str(out)) == _shard_checksums(str(reference))
    store = open_store(str(out))
    assert [store[i]["sample_id"] for i in range(len(store))] == [f"m{i}" for i in range(120)]
    assert verify_store(str(out)).ok
