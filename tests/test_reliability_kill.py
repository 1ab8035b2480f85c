"""Kill it: SIGKILL real `beagle-pipeline extract` and `beagle-pipeline train` processes at random
(seeded) points, rerun, and compare with uninterrupted runs. Also: a second extraction into a store that
is being written is refused (the lock), and a disk-full manifest write leaves no store that looks complete.

Extraction drivers join one Ray started by this module, so killing a driver leaves nothing behind but the
actors Ray itself reaps; every spawned process gets its own process group, killed at the end.
"""
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from beagle.torch_store import open_store
from pipeline.store import committed_shards, verify_store
from tests.local_ray import local_ray
from tests.small_fs import mounted_small_tmpfs
from tests.tiny import build_target
from tests.tiny_store import build_tiny_store

pytestmark = pytest.mark.slow

BIN = str(Path(sys.executable).with_name("beagle-pipeline"))
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([BIN, *args], env=ENV, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process and anything it started (its own session), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wait_for(condition, process: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"process ended before {what}: {process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            _kill_group(process)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


# Training ---------------------------------------------------------------------------------------------

TRAIN = ["--batch-tokens", "80", "--lr", "3e-3", "--warmup-steps", "3", "--window-size", "3",
         "--simulation-steps", "2", "--vocab-chunk", "128", "--stage1-epochs", "1", "--stage2-epochs", "1",
         "--checkpoint-every", "2", "--device", "cpu", "--seed", "0", "--no-progress"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_in_process(*args: str) -> None:
    """The same CLI in this process, on one thread like the killed subprocess (bitwise-equal floats)."""
    import torch

    from pipeline.commands.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = CliRunner().invoke(train, list(args))
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output


def test_sigkill_training_after_a_checkpoint_then_resume_gives_the_same_curve(tmp_path):
    store = build_tiny_store(tmp_path / "store", num_samples=16)
    full = tmp_path / "full"
    _train_in_process("--store", store, "--out", str(full), *TRAIN)
    reference = _metrics(full)
    steps = len(reference)
    assert steps >= 12 and {m["stage"] for m in reference} == {1, 2}

    rng = random.Random(9)
    checkpoint = rng.choice(range(4, steps - 4, 2))    # the checkpoint to resume from
    extra = 1                                          # a step logged after it, lost with the kill
    part = tmp_path / "part"
    process = subprocess.Popen([BIN, "train", "--store", store, "--out", str(part), *TRAIN],
                               env={**ENV, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: (part / "checkpoints" / f"step-{checkpoint:08d}" / "state.json").is_file()
                  and (part / "metrics.jsonl").is_file()
                  and len((part / "metrics.jsonl").read_text().splitlines()) >= checkpoint + extra,
                  process, 240, f"checkpoint {checkpoint}")
        os.kill(process.pid, signal.SIGKILL)
    finally:
        _kill_group(process)
    logged = len(_metrics(part))
    assert checkpoint < logged < steps, f"killed at {logged} of {steps} steps: no resume to test"
    assert not (part / "drafter").exists()

    _train_in_process("--store", store, "--out", str(part), *TRAIN, "--resume")
    got = _metrics(part)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in reference]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in reference]
    assert (part / "drafter" / "model.safetensors").read_bytes() == (full / "drafter" / "model.safetensors").read_bytes()


def test_sigkill_in_the_middle_of_a_checkpoint_write_resumes_from_the_one_before(tmp_path):
    """The process is frozen (SIGSTOP) while a checkpoint is half-written in its temporary folder, then
    SIGKILLed: the run resumes from the previous whole checkpoint and its loss curve equals an
    uninterrupted run's; the half-written folder is cleared by the next checkpoint."""
    store = build_tiny_store(tmp_path / "store", num_samples=16)
    train = [*TRAIN[:TRAIN.index("--checkpoint-every")], "--checkpoint-every", "1",
             *TRAIN[TRAIN.index("--checkpoint-every") + 2:]]
    full = tmp_path / "full"
    _train_in_process("--store", store, "--out", str(full), *train)
    reference = _metrics(full)

    part = tmp_path / "part"
    checkpoints = part / "checkpoints"
    process = subprocess.Popen([BIN, "train", "--store", store, "--out", str(part), *train], env=ENV,
                               start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    caught = None
    try:
        deadline = time.monotonic() + 240
        while caught is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("never caught a checkpoint mid-write: " + (process.stdout.read() or "")[-2000:]
                                     if process.poll() is not None else "timed out")
            names = os.listdir(checkpoints) if checkpoints.is_dir() else []
            partial = next((n for n in names if n.startswith(".step-") and n.endswith(".tmp")), None)
            if partial is None or int(partial[len(".step-"):-len(".tmp")]) < 3:  # want whole ones before it
                continue
            os.kill(process.pid, signal.SIGSTOP)
            if (checkpoints / partial).is_dir() and not (checkpoints / partial[1:-4]).exists():
                caught = partial  # frozen between starting this checkpoint and committing it
            else:
                os.kill(process.pid, signal.SIGCONT)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        _kill_group(process)
    step = int(caught[len(".step-"):-len(".tmp")])
    whole = sorted(p.name for p in checkpoints.glob("step-*") if (p / "state.json").is_file())
    assert whole and whole[-1] < f"step-{step:08d}", (caught, whole)

    _train_in_process("--store", store, "--out", str(part), *train, "--resume")
    got = _metrics(part)
    assert [m["step"] for m in got] == [m["step"] for m in reference]
    assert [m["loss"] for m in got] == [m["loss"] for m in reference]
    assert not list(checkpoints.glob(".step-*.tmp"))


# Extraction -----------------------------------------------------------------------------------------------

RECORDS = 48


@pytest.fixture(scope="module")
def ray_address():
    with local_ray(num_cpus=3) as address:
        yield address


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("killjob")
    target = build_target(root / "target", template="chatml")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"k{i}", "conversations": [
        {"from": "human", "value": f"Tell me about {i} " * (1 + i % 4)},
        {"from": "gpt", "value": f"Here is what I know about {i}. " * (1 + i % 5)}]}) + "\n"
        for i in range(RECORDS)) + "not json\n")
    return {"root": root, "target": str(target), "data": str(data)}


def _extract_args(job, out: Path, address: str) -> list[str]:
    return ["extract", "--model", job["target"], "--data", job["data"], "--out", str(out), "--dtype", "float32",
            "--samples-per-shard", "1", "--max-length", "64", "--num-workers", "1", "--address", address,
            "--no-progress"]


def _config(job, out: Path):
    from pipeline.extract.pipeline import ExtractConfig
    return ExtractConfig(model_path=job["target"], data=(job["data"],), out=str(out), dtype="float32",
                         samples_per_shard=1, max_length=64, num_workers=1)


def _per_sample(url: str) -> list[tuple]:
    store = open_store(url, verify="first-read")
    return [(s["sample_id"], s["input_ids"].tolist(), s["loss_mask"].tolist(), s["hidden_states"].numpy().tobytes())
            for s in (store[i] for i in range(len(store)))]


def _forward_actor_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"ShardExtractor" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_five_sigkills_of_the_extract_driver_then_the_store_equals_an_uninterrupted_run(ray_address, job):
    from pipeline.extract.pipeline import run_extract

    out = job["root"] / "killed"
    args = _extract_args(job, out, ray_address)
    rng = random.Random(20261129)
    history = []

    # Kill 1, with a second extraction in the middle: the first driver holds the lock (it has written
    # _pending.json) and is paused, so the second meets the lock for certain, and must refuse.
    first = _spawn(*args)
    try:
        _wait_for(lambda: (out / "_pending.json").exists(), first, 240, "the first driver to claim the store")
        os.kill(first.pid, signal.SIGSTOP)
        second = subprocess.run([BIN, *args], env=ENV, capture_output=True, text=True, timeout=240)
        assert second.returncode == 1, second.stdout + second.stderr
        assert "is being written by another process" in second.stderr and "_lock" in second.stderr, second.stderr
        os.kill(first.pid, signal.SIGKILL)
    finally:
        _kill_group(first)
    history.append(("after claiming the store", len(committed_shards(str(out)))))

    # Kills 2..5 at random points: during start-up (imports, tokenizing, joining Ray, actor start), or
    # after a random number of newly committed shards plus a random delay.
    kinds = ["start-up", "shards", "shards", rng.choice(["start-up", "shards"])]
    rng.shuffle(kinds)
    for kind in kinds:
        before = len(committed_shards(str(out)))
        wanted, delay = before + rng.randint(1, 4), rng.uniform(0.0, 0.05)
        driver = _spawn(*args)
        try:
            if kind == "start-up":
                time.sleep(rng.uniform(0.3, 3.0))
            else:
                _wait_for(lambda: len(committed_shards(str(out))) >= wanted, driver, 240, f"{wanted} shards")
                time.sleep(delay)
            assert driver.poll() is None, "the driver finished before its kill: make the job longer"
            os.kill(driver.pid, signal.SIGKILL)
        finally:
            _kill_group(driver)
        history.append((kind, len(committed_shards(str(out)))))
        assert not (out / "manifest.json").exists()
    counts = [n for _, n in history]
    assert counts == sorted(counts) and 2 <= counts[-1] < RECORDS - 10, history

    # The last rerun completes the job, keeping committed shards. A Ray worker is killed in the middle of
    # a shard (ideally while its temporary folder exists, i.e. half written): Ray restarts the actor and
    # the shard is redone. (tests/test_extract_ray.py kills one between shards.)
    final = _spawn(*args)
    shards, killed, mid_write = out / "shards", [], False
    try:
        _wait_for(lambda: len(committed_shards(str(out))) >= counts[-1] + 1, final, 240, "a new shard")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not mid_write:
            mid_write = any(".tmp-" in name for name in os.listdir(shards))
        killed = _forward_actor_pids()
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        stdout, _ = final.communicate(timeout=300)
    finally:
        _kill_group(final)
    assert killed and final.returncode == 0, stdout[-3000:]
    kept = re.search(r"\((\d+) kept from an earlier run", stdout)
    assert kept and counts[-1] <= int(kept.group(1)) < RECORDS, stdout  # + a shard an orphan finished
    logging.getLogger(__name__).warning("kills: %s; actor killed mid-write: %s", history, mid_write)

    reference = job["root"] / "reference"
    summary = run_extract(_config(job, reference))
    store = open_store(str(out))
    assert store.dataset_id == summary.dataset_id
    assert verify_store(str(out)).ok
    ids = [store[i]["sample_id"] for i in range(len(store))]
    rejected = {json.loads(line)["index"] for line in (out / "rejects.jsonl").read_text().splitlines()}
    assert len(ids) == len(set(ids)) == summary.samples > RECORDS // 2  # none doubled
    assert ids == [f"k{i}" for i in range(RECORDS) if i not in rejected]  # none lost, input order
    assert _per_sample(str(out)) == _per_sample(str(reference))
    assert (out / "rejects.jsonl").read_bytes() == (reference / "rejects.jsonl").read_bytes()
    assert not [p for p in shards.iterdir() if ".tmp-" in p.name]


def test_disk_full_at_the_manifest_leaves_an_unfinished_store_and_says_so(ray_address, job, monkeypatch):
    """ENOSPC injected at the driver's last write (the manifest): the CLI says the store is unfinished,
    readers refuse it, and the same command then completes it."""
    from pipeline.cli import main
    from pipeline.store import atomic

    out = job["root"] / "full-disk"
    real = atomic.write_bytes

    def no_space(path, payload, **options):
        if str(path).endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, payload, **options)

    monkeypatch.setattr(atomic, "write_bytes", no_space)
    args = _extract_args(job, out, ray_address)[:-3] + ["--no-progress"]  # in-process: use this Ray
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "No space left on device" in result.output and "unfinished" in result.output, result.output
    with pytest.raises(Exception, match="unfinished store"):
        open_store(str(out))
    monkeypatch.setattr(atomic, "write_bytes", real)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    store = open_store(str(out))
    assert verify_store(str(out)).ok
    assert len(store) + store.manifest["counts"]["rejected"] == RECORDS + 1  # every line: stored or rejected


# Repairs ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clean_store(ray_address, job) -> Path:
    from pipeline.extract.pipeline import run_extract

    out = job["root"] / "clean"
    run_extract(_config(job, out))
    return out


def _as_interrupted(clean: Path, out: Path) -> None:
    """A copy of `clean` as a crash before the manifest leaves it: every shard committed, no manifest."""
    shutil.copytree(clean, out)
    manifest = out / "manifest.json"
    dataset_id = json.loads(manifest.read_text())["dataset_id"]
    manifest.unlink()
    (out / "_pending.json").write_text(json.dumps({"dataset_id": dataset_id}))


@pytest.mark.parametrize("damage", ["truncate", "flip-states", "flip-samples", "garble-shard-json"])
def test_a_damaged_committed_shard_is_written_again_on_rerun(clean_store, job, damage):
    """Checksums, not sizes, decide which committed shards a rerun keeps: a truncated file, a flipped byte
    in the states or the sample table, or an unreadable shard.json, each sends its shard back to be
    written; the store then verifies and equals a clean run sample for sample."""
    from pipeline.extract.pipeline import run_extract

    out = job["root"] / f"damaged-{damage}"
    _as_interrupted(clean_store, out)
    shard = out / "shards" / "shard-00002"
    files = [p for p in shard.rglob("*") if p.is_file() and p.name not in ("shard.json", "zarr.json")]
    states = max((p for p in files if p.name != "samples.arrow"), key=lambda p: p.stat().st_size)
    if damage == "truncate":
        states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    elif damage == "garble-shard-json":
        (shard / "shard.json").write_text("{not json")
    else:
        victim = states if damage == "flip-states" else shard / "samples.arrow"
        payload = bytearray(victim.read_bytes())
        payload[len(payload) // 2] ^= 0xFF  # same size: a size check would keep it
        victim.write_bytes(bytes(payload))

    summary = run_extract(_config(job, out))
    assert summary.shards_resumed == summary.shards - 1
    assert verify_store(str(out)).ok
    assert _per_sample(str(out)) == _per_sample(str(clean_store))


def test_rerunning_the_same_extract_repairs_a_damaged_complete_store(clean_store, job):
    """A finished store with a flipped byte in one shard's states and in its head: a rerun of the same
    command hashes every file of the store, writes that shard and the head again (the other shards are
    kept), and the store verifies and equals a clean run sample for sample."""
    from pipeline.extract.pipeline import run_extract

    out = job["root"] / "complete-damaged"
    shutil.copytree(clean_store, out)
    states = out / "shards" / "shard-00002" / "hidden_states" / "layer_m1" / "c" / "0" / "0"
    for victim in (states, out / "head.safetensors"):
        payload = bytearray(victim.read_bytes())
        payload[len(payload) // 2] ^= 0x01  # same size: only a checksum sees it
        victim.write_bytes(bytes(payload))
    assert not verify_store(str(out)).ok
    summary = run_extract(_config(job, out))
    assert summary.state == "resume" and summary.shards_resumed == summary.shards - 1
    assert verify_store(str(out)).ok
    assert _per_sample(str(out)) == _per_sample(str(clean_store))
    assert (out / "head.safetensors").read_bytes() == (clean_store / "head.safetensors").read_bytes()
    assert run_extract(_config(job, out)).state == "complete"


def test_an_input_changed_while_extract_runs_is_refused_and_nothing_of_it_is_committed(ray_address, job):
    """The input file is swapped for one with as many records and other content after extract hashed it
    (when its progress bar starts, before the records are read for good), by a rename or by a rewrite in
    place: the job stops with one line naming the file, before any shard of the new bytes is forwarded,
    and leaves nothing a rerun must overwrite; the rerun with the final file builds a store whose
    recorded sha256 is that of the bytes it holds."""
    import hashlib

    from pipeline.extract.pipeline import run_extract

    data = job["root"] / "changing.jsonl"
    original = Path(job["data"]).read_bytes()
    swapped = original.replace(b"Here is what I know about", b"Nobody knows a thing about")
    assert swapped.count(b"\n") == original.count(b"\n") and swapped != original
    out = job["root"] / "provenance"
    config = replace(_config(job, out), data=(str(data),), samples_per_shard=16)

    class SwapWhenStarted:
        def __init__(self, how: str) -> None:
            self.how = how

        def start(self, total: int) -> None:
            if self.how == "replaced":
                data.with_suffix(".new").write_bytes(swapped)
                os.replace(data.with_suffix(".new"), data)
            else:
                time.sleep(0.05)  # past the file system's timestamp granularity since the file was written
                with open(data, "r+b") as handle:
                    handle.write(swapped)

        def advance(self, records: int, tokens: int, *, this_run: bool) -> None:
            pass

    for how in ("replaced", "rewritten_in_place"):
        data.write_bytes(original)
        with pytest.raises(ValueError, match=f"--data {re.escape(str(data))}: changed while extract ran"):
            run_extract(config, progress=SwapWhenStarted(how))
        assert not (out / "manifest.json").exists() and not committed_shards(str(out))
        assert not (out / "_pending.json").exists()  # the rerun with other bytes needs no --overwrite
    summary = run_extract(config)  # the file is final now (the swapped content)
    store = open_store(str(out))
    assert summary.state == "new" and summary.samples > 0 and verify_store(str(out)).ok
    assert store.manifest["source"]["files"][0]["sha256"] == hashlib.sha256(swapped).hexdigest()
    assert hashlib.sha256(data.read_bytes()).hexdigest() == hashlib.sha256(swapped).hexdigest()


def test_overwrite_keeps_a_store_of_the_same_inputs_and_clears_what_crashed_writers_left(clean_store, job):
    """--overwrite deletes only a store of OTHER inputs; one of the same inputs stays as it is. Temporary
    files and build folders of interrupted writers are removed by the next run."""
    from pipeline.extract.pipeline import run_extract

    out = job["root"] / "overwrite"
    shutil.copytree(clean_store, out)
    manifest = (out / "manifest.json").read_bytes()
    leftovers = [out / "head.safetensors.tmp-4242-deadbeef", out / "shards" / ".shard-00001.tmp-4242-deadbeef"]
    leftovers[0].write_bytes(b"\0" * 4096)
    leftovers[1].mkdir()
    (leftovers[1] / "samples.arrow").write_bytes(b"partial")

    summary = run_extract(replace(_config(job, out), overwrite=True))
    assert summary.state == "complete"
    assert (out / "manifest.json").read_bytes() == manifest
    assert not [p for p in leftovers if p.exists()]
    assert verify_store(str(out)).ok

    other = run_extract(replace(_config(job, out), overwrite=True, max_length=48))  # other settings: replaced
    assert other.dataset_id != summary.dataset_id and other.state != "complete"
    assert open_store(str(out)).dataset_id == other.dataset_id and verify_store(str(out)).ok


def test_an_all_rejected_input_leaves_nothing_that_blocks_the_corrected_rerun(ray_address, job):
    """A job whose every record is rejected stops with one line and leaves no half-made store: the rerun
    with the corrected input (other inputs, so another dataset_id) needs no --overwrite."""
    from pipeline.extract.pipeline import run_extract

    bad = job["root"] / "all-bad.jsonl"
    bad.write_text('{"conversations": [{"from": "tool", "value": "x"}]}\nnot json\n')
    out = job["root"] / "corrected"
    with pytest.raises(ValueError, match="all 2 records were rejected"):
        run_extract(replace(_config(job, out), data=(str(bad),)))
    assert not (out / "_pending.json").exists() and not (out / "manifest.json").exists()
    empty = job["root"] / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no records in the input; nothing to extract$"):
        run_extract(replace(_config(job, out), data=(str(empty),)))
    summary = run_extract(_config(job, out))
    assert summary.samples > 0 and verify_store(str(out)).ok


@pytest.fixture
def small_filesystem(job):
    """A real size-limited filesystem (tmpfs), which needs mount privileges (root in the CI container)."""
    yield from mounted_small_tmpfs(job["root"] / f"small-fs-{os.getpid()}-{random.randrange(1 << 30)}")


def test_a_full_disk_inside_a_forward_actor_stops_the_job_then_the_rerun_completes(ray_address, job, clean_store,
                                                                                  small_filesystem):
    """The store lives on a real filesystem too small for it: a forward actor meets ENOSPC while writing a
    shard. The job stops with one line naming the store, the shards committed before stay, and once
    space is freed (the tmpfs grown) the same command resumes and the store verifies and equals a clean run."""
    from pipeline.cli import main

    size = sum(p.stat().st_size for p in clean_store.rglob("*") if p.is_file())
    subprocess.run(["mount", "-o", f"remount,size={max(64 << 10, size // 2)}", str(small_filesystem)], check=True)
    out = small_filesystem / "store"
    args = _extract_args(job, out, ray_address)[:-3] + ["--no-progress"]  # in-process: use this Ray
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]  # Ray may log its own
    assert len(errors) == 1 and "No space left on device" in errors[0] and str(out) in errors[0], result.output
    assert "Traceback" not in result.output and "UserCodeException" not in result.output, result.output
    assert not (out / "manifest.json").exists()
    kept = committed_shards(str(out))
    assert kept, "nothing was committed before the disk filled: the test proves nothing"

    subprocess.run(["mount", "-o", f"remount,size={4 * size + (1 << 20)}", str(small_filesystem)], check=True)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert all(committed_shards(str(out))[k] == info for k, info in kept.items())  # what was committed stayed
    assert verify_store(str(out)).ok
    assert _per_sample(str(out)) == _per_sample(str(clean_store))
