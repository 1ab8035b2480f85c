"""A store's files as a hostile sender could make them: links to devices, FIFOs, foreign folders at --out,
sample tables rewritten with consistent checksums. Every case is real files on disk, read by the real
readers, `verify`, `info` and `train`; each refusal is one line naming the file."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from beagle.torch_store import open_store
from pipeline.cli import main as cli_main
from pipeline.store import StoreFormatError, verify_store
from tests.small_fs import mounted_small_tmpfs
from tests.test_store import build, make_samples

TABLE = "shards/shard-00001/samples.arrow"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A 3-shard bfloat16 store with rejects (4 samples per shard)."""
    url = tmp_path_factory.mktemp("pristine") / "store"
    build(str(url), make_samples(10, torch.bfloat16), "bfloat16",
          rejects=[{"reason": "too_large", "index": 3}, {"reason": "malformed_json", "index": 5}])
    assert verify_store(str(url)).ok
    return url


def _copy(pristine: Path, tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(pristine, store)
    return store


def _fifo_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _one_line(output: str) -> str:
    """The refusal: one line (verify adds its count of problems below it), no traceback."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert "Traceback" not in output and (len(lines) == 1 or len(lines) == 2 and "problem(s) found" in lines[1]), \
        output
    return lines[0]


# Files that are not regular files -------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["link_to_dev_zero", "fifo"])
def test_a_manifest_that_is_a_device_or_a_fifo_is_refused_without_reading_it(pristine, tmp_path, kind):
    """/dev/zero never ends (a plain read() grows until MemoryError); opening a FIFO blocks until a
    writer comes. info, verify, the readers and train each refuse at once with one line."""
    store = _copy(pristine, tmp_path)
    manifest = store / "manifest.json"
    if kind == "fifo":
        _fifo_in_place_of(manifest)
        expected = "manifest.json: a FIFO, not a regular file"
    else:
        manifest.unlink()
        manifest.symlink_to("/dev/zero")
        expected = "manifest.json: a link to /dev/zero, outside the store"
    runner = CliRunner()
    for command in (["info", str(store)], ["verify", "--no-progress", str(store)],
                    ["train", "--store", str(store), "--out", str(tmp_path / "run"), "--device", "cpu",
                     "--no-progress"]):
        result = runner.invoke(cli_main, command)
        assert result.exit_code == 1, (command, result.output)
        line = _one_line(result.output)
        assert expected in line, (command, line)
    for verify in ("none", "first-read"):
        with pytest.raises(StoreFormatError, match=expected):
            open_store(str(store), verify=verify)
    assert not (tmp_path / "run" / "run_config.json").exists()


@pytest.mark.timeout(60)
def test_an_unlisted_rejects_file_is_never_read(pristine, tmp_path):
    """rejects.jsonl that the manifest does not list, linked to /dev/zero: verify reports it as unlisted
    (and the counts it cannot back), without opening it."""
    store = _copy(pristine, tmp_path)
    manifest = store / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["files"]["rejects.jsonl"]
    manifest.write_text(json.dumps(data))
    (store / "rejects.jsonl").unlink()
    (store / "rejects.jsonl").symlink_to("/dev/zero")
    report = verify_store(str(store))
    assert "rejects.jsonl" in report.unlisted
    assert any("rejects.jsonl: holds {}" in p for p in report.problems), report.problems


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["rejects.jsonl", TABLE, "shards/shard-00001/hidden_states/layer_m1/zarr.json",
                                  "shards/shard-00001/hidden_states/layer_m1/c/0/0", "head.safetensors"])
def test_a_listed_file_that_is_a_fifo_is_refused_without_blocking(pristine, tmp_path, name):
    """A FIFO inside the store with the recorded size 0 passing no size check would block any open();
    verify names it, and every reader refuses the store (or the shard) before opening it."""
    store = _copy(pristine, tmp_path)
    _fifo_in_place_of(store / name)
    expected = f"{name}: a FIFO, not a regular file"
    report = verify_store(str(store))
    assert any(expected in p for p in report.problems), report.problems
    with pytest.raises(StoreFormatError, match=expected):
        opened = open_store(str(store), verify="first-read")
    if name != "rejects.jsonl":  # which no reader but verify opens
        opened = open_store(str(store), verify="none", check_files=False)  # checked as it is read
        with pytest.raises(StoreFormatError, match=expected):
            opened.load_head()
            for index in range(len(opened)):
                opened[index]
    result = CliRunner().invoke(cli_main, ["train", "--store", str(store), "--out", str(tmp_path / "run"),
                                           "--device", "cpu", "--no-progress", "--no-verify-store"])
    assert result.exit_code == 1 and expected in _one_line(result.output), result.output


# --overwrite deletes only a store of ours, and only its files ---------------------------------------

def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != "_lock"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from tests.tiny import build_target

    return build_target(tmp_path_factory.mktemp("target"), template="chatml_generation")


def _extract_overwrite(target: Path, tmp_path: Path, out: Path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello."}]}) + "\n")
    return CliRunner().invoke(cli_main, ["extract", "--model", str(target), "--data", str(chats), "--out", str(out),
                                         "--overwrite", "--no-progress"])


def _merge_overwrite(pristine: Path, tmp_path: Path, out: Path):
    other = tmp_path / "other"
    if not other.exists():
        samples = make_samples(3, torch.bfloat16, seed=5)
        for sample in samples:
            sample["sample_id"] = "other-" + sample["sample_id"]
        build(str(other), samples, "bfloat16")
    return CliRunner().invoke(cli_main, ["merge", "--no-progress", str(pristine), str(other), "--out", str(out),
                                         "--overwrite"])


@pytest.mark.parametrize("command", ["extract", "merge"])
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["foreign_manifest", "garbled_manifest", "fifo_manifest", "foreign_pending",
                                  "store_with_a_stranger", "stranger_in_a_shard"])
def test_overwrite_deletes_nothing_that_is_not_provably_a_store_of_ours(pristine, target, tmp_path, command, case):
    """A web app's folder with its own manifest.json, a folder whose _pending.json is not ours, and real
    stores of other inputs holding a file they do not list: `--overwrite` refuses with one line naming
    what is in the way, before any Ray or model start-up, and every byte stays."""
    out = tmp_path / "out"
    if case == "foreign_manifest":
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"name": "webapp", "version": "1.0", "icons": []}))
        (out / "index.html").write_text("<html></html>")
        expected = "holds a manifest.json that is not a beagle-pipeline store's"
    elif case in ("garbled_manifest", "fifo_manifest"):
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
        if case == "garbled_manifest":
            (out / "manifest.json").write_text("{not json")
            expected = "manifest.json: not valid JSON"
        else:
            os.mkfifo(out / "manifest.json")
            expected = "manifest.json: a FIFO, not a regular file"
    elif case == "foreign_pending":
        out.mkdir()
        (out / "_pending.json").write_text(json.dumps({"job": 17, "dataset_id": ["x"]}))
        (out / "thesis.tex").write_text("\\documentclass{article}")
        expected = "holds a _pending.json that is not a beagle-pipeline store's"
    else:
        shutil.copytree(pristine, out)
        stranger = "notes.txt" if case == "store_with_a_stranger" else "shards/shard-00001/results.csv"
        (out / stranger).write_text("keep me")
        expected = f"--overwrite deletes only a store's own files, and {stranger} is not one"
    before = _tree(out)  # regular files only: a FIFO is never opened
    run = _extract_overwrite if command == "extract" else _merge_overwrite
    result = run(target if command == "extract" else pristine, tmp_path, out)
    assert result.exit_code == 1, result.output
    assert expected in _one_line(result.output) and "nothing was deleted" in result.output, result.output
    assert _tree(out) == before
    assert case != "fifo_manifest" or (out / "manifest.json").is_fifo()


def test_overwrite_deletes_a_store_of_ours_with_its_temporaries_and_builds_the_new_one(pristine, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(pristine, out)
    (out / "head.safetensors.tmp-123-abcd").write_bytes(b"half a head")
    (out / "shards" / ".shard-00007.tmp-1-ff").mkdir()
    (out / "shards" / ".shard-00007.tmp-1-ff" / "samples.arrow").write_bytes(b"half a shard")
    result = _merge_overwrite(pristine, tmp_path, out)
    assert result.exit_code == 0, result.output
    assert verify_store(str(out)).ok and not verify_store(str(out)).unlisted
    assert len(open_store(str(out))) == 13


# Structure, not just checksums -----------------------------------------------------------------------

def _rewrite_table(store: Path, shard: int, edit) -> None:
    """Rewrite shard `shard`'s sample table through `edit(columns)` and fix every checksum and size that
    records it (shard.json and the manifest), as someone who forges a store consistently would."""
    import hashlib

    import pyarrow as pa

    from pipeline.store.writer import SAMPLES_SCHEMA

    name = f"shard-{shard:05d}"
    relative = f"shards/{name}/samples.arrow"
    path = store / relative
    with pa.memory_map(str(path)) as source:
        columns = pa.ipc.open_stream(source).read_all().to_pydict()
    edit(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SAMPLES_SCHEMA) as writer:
        writer.write_table(pa.Table.from_pydict(columns, schema=SAMPLES_SCHEMA))
    payload = sink.getvalue().to_pybytes()
    path.unlink()
    path.write_bytes(payload)
    entry = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    info_path = store / "shards" / name / "shard.json"
    info = json.loads(info_path.read_text())
    info["files"][relative] = entry
    info_path.write_text(json.dumps(info))
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["shards"][shard]["files"][relative] = entry
    (store / "manifest.json").write_text(json.dumps(manifest))


def _set(column: str, row: int, value):
    def edit(columns):
        columns[column][row] = value
    return edit


def _set_item(column: str, row: int, position: int, value):
    def edit(columns):
        columns[column][row][position] = value
    return edit


STRUCTURE = {  # damage: (shard, edit, what the refusal says)
    "negative_offset": (1, _set("token_offset", 2, -5), "has token_offset -5, not"),
    "huge_offset": (1, _set("token_offset", 3, 10 ** 12), "has token_offset 1000000000000, not"),
    "overlapping_offsets": (1, _set("token_offset", 1, 0), "has token_offset 0, not"),
    "negative_token_id": (1, _set_item("input_ids", 0, 1, -3), "a negative token id (-3)"),
    "token_id_past_the_vocabulary": (1, _set_item("input_ids", 0, 1, 300), "token id 300 >= the vocabulary size 300"),
    "mask_of_seven": (1, _set_item("loss_mask", 2, 0, 7), "loss_mask value 7, not 0 or 1"),
    "duplicate_id_in_a_shard": (1, _set("sample_id", 1, "s0-4"), "sample id 's0-4' appears more than once"),
    "duplicate_id_across_shards": (2, _set("sample_id", 0, "s0-4"),
                                   "sample id 's0-4' appears in shards/shard-00001 and in shards/shard-00002"),
}


@pytest.fixture(scope="module")
def trainable(tmp_path_factory) -> Path:
    """A 4-shard float32 store of the tiny target's real states that `train` trains on."""
    from tests.test_reliability_store import _build

    return Path(_build(tmp_path_factory.mktemp("trainable") / "store", seed=0))


@pytest.mark.parametrize("damage", list(STRUCTURE))
def test_structure_is_checked_not_just_checksums(trainable, tmp_path, damage):
    """Sample tables rewritten with their checksums fixed: offsets out of the shard or overlapping,
    token ids outside the vocabulary, a mask value of 7, a duplicate sample id. verify names the
    problem, every reader refuses the shard, and train refuses with one line before its first step."""
    from tests.test_reliability_store import TRAIN_FLAGS

    store = _copy(trainable, tmp_path)
    shard, edit, expected = STRUCTURE[damage]
    _rewrite_table(store, shard, edit)
    report = verify_store(str(store))
    assert any(expected in p for p in report.problems), report.problems
    for verify in ("none", "first-read"):
        opened = open_store(str(store), verify=verify)
        with pytest.raises(StoreFormatError, match="damaged or hostile"):
            for index in range(len(opened)):
                opened[index]
            opened.lengths  # what every trainer and eval reads first; checks ids across the shards too
    run = tmp_path / "run"
    result = CliRunner().invoke(cli_main, ["train", "--store", str(store), "--out", str(run), *TRAIN_FLAGS])
    assert result.exit_code == 1, result.output
    assert expected in _one_line(result.output), result.output
    assert not (run / "metrics.jsonl").exists() and not (run / "run_config.json").exists()


# Messages: one line, naming the command to rerun ----------------------------------------------------

@pytest.fixture
def small_filesystem(tmp_path):
    """A real size-limited filesystem (tmpfs), which needs mount privileges (root in the CI container)."""
    yield from mounted_small_tmpfs(tmp_path / "small-fs")


def test_a_full_disk_during_merge_is_one_line_and_info_names_the_merge_to_rerun(tmp_path, small_filesystem):
    """A merge onto a real tmpfs too small for it: one line naming the store and the command to rerun (no
    traceback); `info` on the unfinished merge names `beagle-pipeline merge`, not extract; once the tmpfs
    is grown, the same merge completes a store that verifies."""
    import subprocess

    from tests.test_store import CLI

    first, second = make_samples(40, torch.float32, seed=1), make_samples(40, torch.float32, seed=2)
    for index, sample in enumerate(second):
        sample["sample_id"] = f"other-{index}"
    build(str(tmp_path / "a"), first, "float32")
    build(str(tmp_path / "b"), second, "float32")
    out = small_filesystem / "merged"
    merge = [*CLI, "merge", "--no-progress", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]
    result = subprocess.run(merge, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)
    assert "No space left on device" in line and str(out) in line and "`beagle-pipeline merge`" in line, line
    assert not (out / "manifest.json").exists()
    info = subprocess.run([*CLI, "info", str(out)], capture_output=True, text=True, timeout=60)
    assert info.returncode == 1
    line = _one_line(info.stderr)
    assert "unfinished store" in line and "rerun the same `beagle-pipeline merge` command" in line, line
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_filesystem)], check=True)
    result = subprocess.run(merge, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert verify_store(str(out)).ok and len(open_store(str(out))) == 80


# A rerun of a complete store checks what it keeps ---------------------------------------------------

def test_rerunning_the_same_merge_repairs_a_damaged_complete_store(pristine, tmp_path):
    """A finished merge with a flipped byte in one shard's states and in its head: rerunning the same merge
    hashes every file it would keep, rewrites the damaged shard and head, and the store verifies again;
    an intact complete store is kept as it is."""
    out = tmp_path / "out"
    assert _merge_overwrite(pristine, tmp_path, out).exit_code == 0
    clean = _tree(out)
    for name in ("shards/shard-00000/hidden_states/layer_m1/c/0/0", "head.safetensors"):
        payload = bytearray((out / name).read_bytes())
        payload[len(payload) // 2] ^= 0x01  # same size: only a checksum sees it
        (out / name).write_bytes(bytes(payload))
    assert not verify_store(str(out)).ok
    result = _merge_overwrite(pristine, tmp_path, out)
    assert result.exit_code == 0, result.output
    assert verify_store(str(out)).ok and _tree(out) == clean
    untouched = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert _merge_overwrite(pristine, tmp_path, out).exit_code == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == untouched
