"""Damaged, foreign and hostile stores: the trainer and eval refuse them, naming the file, and nothing
in a store is ever executed or read from outside it. (`verify` on each damage kind: tests/test_store.py.)"""
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.commands.train import train as train_command
from pipeline.cli import main as cli_main
from beagle.torch_store import open_store
from pipeline.extract.state_encoding import write_store
from pipeline.store import StoreError, StoreFormatError, verify_store
from tests.tiny_store import _architecture, _sequences, tiny_target

REPO = Path(__file__).resolve().parents[1]
TRAIN_FLAGS = ["--max-steps", "2", "--batch-tokens", "160", "--lr", "3e-3", "--warmup-steps", "1",
               "--window-size", "3", "--simulation-steps", "2", "--vocab-chunk", "128", "--device", "cpu",
               "--no-progress"]
HIDDEN = "shards/shard-00001/hidden_states/layer_m1/c/0/0"
TABLE = "shards/shard-00001/samples.arrow"


def _build(path: Path, *, seed: int) -> str:
    """A 4-shard float32 store of the tiny target's real states (4 samples per shard)."""
    model = tiny_target(0)
    samples = []
    with torch.no_grad():
        for i, ids in enumerate(_sequences(16, model.config.vocab_size, seed, 12, 30)):
            hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]  # [L, d]
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(ids) // 2:] = True
            samples.append({"sample_id": f"s{seed}-{i}", "input_ids": ids, "loss_mask": mask,
                            "hidden_states": hidden[None]})
    target = {"name": "tiny-llama-0", "config_sha256": "c" * 64, "weights_sha256": "w" * 64,
              "architecture": _architecture(model.config)}
    write_store(str(path), samples, samples_per_shard=4,
                head={"embed_tokens": model.get_input_embeddings().weight.detach().clone(),
                      "lm_head": model.get_output_embeddings().weight.detach().clone()},
                target=target, tokenizer={"name": "none"}, capture={"layers": [-1], "dtype": "float32",
                                                                     "max_length": 30},
                source={"name": "random-walk", "seed": seed})
    return str(path)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    good, other = _build(root / "good", seed=0), _build(root / "other", seed=7)
    assert verify_store(good).ok and verify_store(other).ok
    return Path(good), Path(other)


def _damage(pristine, tmp_path, kind: str) -> tuple[Path, str]:
    """A copy of the good store with one kind of damage; returns (store, text the refusal must contain)."""
    good, other = pristine
    store = tmp_path / "store"
    shutil.copytree(good, store)
    if kind == "flipped_byte_states":
        data = bytearray((store / HIDDEN).read_bytes())
        data[100] ^= 0x01
        (store / HIDDEN).write_bytes(bytes(data))
        return store, f"{HIDDEN}: blake3 mismatch"
    if kind == "flipped_byte_table":
        data = bytearray((store / TABLE).read_bytes())
        data[len(data) // 2] ^= 0x10
        (store / TABLE).write_bytes(bytes(data))
        return store, f"{TABLE}: blake3 mismatch"
    if kind == "truncated":
        (store / HIDDEN).write_bytes((store / HIDDEN).read_bytes()[:-9])
        return store, f"{HIDDEN}: "
    if kind == "deleted_shard":
        shutil.rmtree(store / "shards" / "shard-00002")
        return store, "shards/shard-00002/"
    if kind == "edited_identity":
        manifest = json.loads((store / "manifest.json").read_text())
        manifest["capture"]["max_length"] = 4096
        (store / "manifest.json").write_text(json.dumps(manifest))
        return store, "dataset_id does not match"
    if kind == "edited_counts":
        manifest = json.loads((store / "manifest.json").read_text())
        manifest["counts"]["samples"] += 1
        (store / "manifest.json").write_text(json.dumps(manifest))
        return store, "counts.samples"
    if kind == "foreign_shard":
        shutil.rmtree(store / "shards" / "shard-00001")
        shutil.copytree(other / "shards" / "shard-00001", store / "shards" / "shard-00001")
        return store, "shards/shard-00001/"
    raise AssertionError(kind)


KINDS = ["flipped_byte_states", "flipped_byte_table", "truncated", "deleted_shard", "edited_identity",
         "edited_counts", "foreign_shard"]


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_refuses_a_damaged_store_and_names_the_file(pristine, tmp_path, kind):
    store, expected = _damage(pristine, tmp_path, kind)
    run = tmp_path / "run"
    result = CliRunner().invoke(train_command, ["--store", str(store), "--out", str(run), *TRAIN_FLAGS])
    assert result.exit_code == 1, result.output
    assert expected in result.output and "beagle-pipeline verify" in result.output, result.output
    assert "Traceback" not in result.output
    assert not (run / "run_config.json").exists() and not (run / "checkpoints").exists()  # refused to start


def test_the_refusal_comes_from_verification_and_can_be_skipped(pristine, tmp_path):
    """--no-verify-store trains on the flipped store (the flip is a finite float): so it is the checksum
    on first read, not some accidental failure, that stops the default run."""
    store, _ = _damage(pristine, tmp_path, "flipped_byte_states")
    result = CliRunner().invoke(train_command, ["--store", str(store), "--out", str(tmp_path / "run"),
                                                *TRAIN_FLAGS, "--no-verify-store"])
    assert result.exit_code == 0, result.output
    assert "trained 2 steps" in result.output


@pytest.mark.slow
def test_real_train_process_refuses_a_foreign_shard(pristine, tmp_path):
    store, expected = _damage(pristine, tmp_path, "foreign_shard")
    command = [str(Path(sys.executable).with_name("beagle-pipeline")), "train", "--store", str(store),
               "--out", str(tmp_path / "run"), *TRAIN_FLAGS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 1, result.stderr[-2000:]
    assert expected in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("kind", ["flipped_byte_table", "truncated", "deleted_shard", "edited_identity",
                                  "foreign_shard"])
def test_eval_refuses_a_damaged_draft_vocab_store_before_loading_models(pristine, tmp_path, kind):
    """eval reads only the sample tables of --draft-vocab-store (token counts): those must be intact."""
    store, expected = _damage(pristine, tmp_path, kind)
    (tmp_path / "empty").mkdir()  # never loaded: the store is checked first
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(cli_main, ["eval", "--model", str(tmp_path / "empty"), "--drafter",
                                           str(tmp_path / "empty"), "--prompts", str(prompts), "--draft-vocab",
                                           "8", "--draft-vocab-store", str(store), "--no-progress"])
    assert result.exit_code == 1 and expected in result.output, result.output  # a data error


# Untrusted stores ------------------------------------------------------------------------------------

class _Payload:
    """Unpickling this creates `marker`: proof that a loader executed code from the store."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickle_bomb(marker: Path, size: int | None = None) -> bytes:
    payload = pickle.dumps(_Payload(marker))
    return payload if size is None else payload + b"\0" * (size - len(payload))  # pickle ignores the tail


def test_the_pickle_payload_is_live(tmp_path):
    """Guard for the tests below: unpickling the payload really does create its marker."""
    marker = tmp_path / "executed"
    pickle.loads(_pickle_bomb(marker, 4096))
    assert marker.exists()


@pytest.mark.parametrize("name", ["head.safetensors", "manifest.json", TABLE,
                                  "shards/shard-00001/hidden_states/layer_m1/zarr.json"])
def test_a_pickle_in_the_store_is_refused_and_never_executed(pristine, tmp_path, name):
    store = tmp_path / "store"
    shutil.copytree(pristine[0], store)
    marker = tmp_path / "executed"
    size = (store / name).stat().st_size  # same size: only the checksum (or the parser) can catch it
    (store / name).write_bytes(_pickle_bomb(marker, size))

    run = tmp_path / "run"
    result = CliRunner().invoke(train_command, ["--store", str(store), "--out", str(run), *TRAIN_FLAGS])
    assert result.exit_code != 0 and (name in result.output or "manifest.json" in result.output), result.output
    # Without verification every reader still refuses it: JSON, Arrow, Zarr metadata and safetensors parse
    # data, never code.
    with pytest.raises(Exception) as refused:
        opened = open_store(str(store), verify="none")
        opened.load_head()
        for i in range(len(opened)):
            opened[i]
    assert isinstance(refused.value, (StoreError, ValueError, OSError)), repr(refused.value)
    assert verify_store(str(store)).problems
    assert not marker.exists()


def test_head_that_is_not_safetensors_is_refused_by_the_plain_reader(pristine, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(pristine[0], store)
    marker = tmp_path / "executed"
    (store / "head.safetensors").write_bytes(_pickle_bomb(marker, (store / "head.safetensors").stat().st_size))
    with pytest.raises(StoreFormatError, match="head.safetensors is not a valid safetensors file"):
        open_store(str(store)).load_head()
    with pytest.raises(StoreError, match="head.safetensors: blake3 mismatch"):
        open_store(str(store), verify="first-read").load_head()
    assert not marker.exists()


@pytest.mark.parametrize("where", ["file", "shard_name"])
@pytest.mark.parametrize("path", ["../outside.bin", "/etc/passwd", "https://example.com/x", "shards/../../x"])
def test_trainer_refuses_manifest_paths_leaving_the_store(pristine, tmp_path, where, path):
    store = tmp_path / "store"
    shutil.copytree(pristine[0], store)
    manifest = json.loads((store / "manifest.json").read_text())
    if where == "file":
        manifest["shards"][0]["files"][path] = {"sha256": "0" * 64, "bytes": 1}
    else:
        manifest["shards"][0]["name"] = path
    (store / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(train_command, ["--store", str(store), "--out", str(tmp_path / "run"),
                                                *TRAIN_FLAGS])
    assert result.exit_code == 1 and re.search("inside the store|leaves the store", result.output), result.output


@pytest.mark.timeout(60)
def test_a_link_out_of_the_store_is_refused_without_reading_it(pristine, tmp_path):
    """A store file replaced by a symlink to a FIFO outside: opening the FIFO for reading would block
    forever (the timeout would fail the test), so passing proves the outside file was never opened."""
    store = tmp_path / "store"
    shutil.copytree(pristine[0], store)
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    (store / TABLE).unlink()
    (store / TABLE).symlink_to(fifo)
    with pytest.raises(StoreFormatError, match="outside the store"):
        open_store(str(store))
    with pytest.raises(StoreFormatError, match="outside the store"):
        open_store(str(store), verify="first-read")
    report = verify_store(str(store))
    assert any(TABLE in p and "outside the store" in p for p in report.problems), report.problems


def test_a_fifo_at_a_shards_commit_marker_is_flagged_by_verify_without_blocking(pristine, tmp_path):
    """shard.json is no listed file (it is the shard's commit marker), yet a FIFO there must not pass `verify`,
    and reading one would block: the check stats, never opens (the call would hang, not fail, if it did)."""
    store = tmp_path / "store"
    shutil.copytree(pristine[0], store)
    marker = next(store.glob("shards/*/shard.json"))
    marker.unlink()
    os.mkfifo(marker)
    report = verify_store(str(store))
    relative = str(marker.relative_to(store))
    assert any(relative in p and "FIFO" in p for p in report.problems), report.problems
    result = CliRunner().invoke(cli_main, ["verify", str(store)])
    assert result.exit_code == 1 and relative in result.output, result.output


@pytest.mark.parametrize("manifest", ['{"schema_version": "1.0", "dataset_id": "x", "hidden_size": 64, '
                                      '"layers": [-1], "dtype": "float32", "shards": "oops", "counts": {}, '
                                      '"target": {}, "files": {}}',
                                      "[" * 100_000 + "]" * 100_000])
def test_a_mistyped_or_absurdly_nested_manifest_is_refused_with_one_line(tmp_path, manifest):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").write_text(manifest)
    with pytest.raises(StoreFormatError, match="wrong type|not valid JSON"):
        open_store(str(tmp_path / "s"))


def test_no_pickle_on_any_load_path():
    """Static guard: nothing in the product unpickles files or calls torch.load / np.load with pickles.

    Not even in memory: both jobs pass records, samples and results to their Ray actors as they are (Ray's
    own serialisation), never as pickles of their own."""
    forbidden = re.compile(r"torch\.load\(|pickle\.load\(|allow_pickle\s*=\s*True|read_pickle|joblib|dill\b|"
                           r"cloudpickle\.load|weights_only\s*=\s*False|marshal\.load")
    offenders, in_memory = [], set()
    for folder in ("beagle", "pipeline", "jobs"):
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = str(path.relative_to(REPO))
            offenders += [f"{rel}: {m.group(0)}" for m in forbidden.finditer(text)]
            if "pickle.loads(" in text:
                in_memory.add(rel)
    assert not offenders, offenders
    assert not in_memory, in_memory


def test_trust_remote_code_is_off_unless_asked(tmp_path):
    """A model directory shipping code (auto_map -> evil.py, which leaves a marker when imported): the
    default extract path loads the built-in classes and never imports it; only the flag does."""
    from pipeline.jobkit.target import load_tokenizer
    from pipeline.extract.cli import extract
    from pipeline.extract.forward import ForwardConfig, TargetForward
    from pipeline.extract.pipeline import ExtractConfig
    from tests.tiny import build_target

    parsed = extract.make_context("extract", ["--model", "m", "--data", "d.jsonl", "--out", "o"]).params
    assert parsed["trust_remote_code"] is False
    assert ExtractConfig(model_path="m", data=("d",), out="o").trust_remote_code is False
    assert ForwardConfig("m", (-1,), "float32").trust_remote_code is False

    target = build_target(tmp_path / "target", template="chatml")
    marker = tmp_path / "executed"
    (target / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig): pass\nclass EvilModel(LlamaForCausalLM): pass\n"
        "class EvilTokenizer(PreTrainedTokenizerFast): pass\n")
    for name, key, value in [("config.json", "AutoConfig", "evil.EvilConfig"),
                             ("tokenizer_config.json", "AutoTokenizer", [None, "evil.EvilTokenizer"])]:
        config = json.loads((target / name).read_text())
        config["auto_map"] = {key: value, **({"AutoModelForCausalLM": "evil.EvilModel"} if name == "config.json"
                                              else {})}
        (target / name).write_text(json.dumps(config))

    load_tokenizer(str(target))
    forward = TargetForward(ForwardConfig(str(target), (-1,), "float32"))
    assert type(forward.model).__name__ == "LlamaForCausalLM"
    assert not marker.exists()
    load_tokenizer(str(target), trust_remote_code=True)  # asked for: now the shipped code runs
    assert marker.exists()


def test_data_parallel_ranks_each_hash_their_share_of_the_shards(pristine, tmp_path, monkeypatch):
    """Under DDP every rank reads (parts of) every shard: hashing on first read in each rank would read
    the whole store once per rank. With verify_share each shard is hashed by one rank; a damaged shard is
    still refused, by the rank whose share it is."""
    from beagle.data import StoreSet
    from pipeline.store import integrity

    good, _ = pristine
    seen: list[str] = []
    real = integrity.file_problem

    def counted(fs, root, relative, meta):
        seen.append(relative)
        return real(fs, root, relative, meta)

    monkeypatch.setattr(integrity, "file_problem", counted)
    world = 2
    for rank in range(world):
        data = StoreSet([str(good)], verify_share=(rank, world))
        seen.clear()
        for i in range(len(data)):
            data.sample(i, 10_000)
        hashed = {p.split("/")[1] for p in seen if p.startswith("shards/")}
        shards = data.stores[0].manifest["shards"]
        assert len(shards) >= world and hashed == {s["name"] for s in shards if s["index"] % world == rank}
    damaged, expected = _damage(pristine, tmp_path, "flipped_byte_states")
    owner = int(HIDDEN.split("/")[1].removeprefix("shard-")) % world
    data = StoreSet([str(damaged)], verify_share=((owner + 1) % world, world))
    for i in range(len(data)):
        data.sample(i, 10_000)  # not this rank's share: read unhashed
    data = StoreSet([str(damaged)], verify_share=(owner, world))
    with pytest.raises(Exception, match=re.escape(expected)):
        for i in range(len(data)):
            data.sample(i, 10_000)
