"""`train` on a CPU runs under jemalloc where one is installed (`make install` unpacks Debian's into .venv/lib),
because glibc's malloc lets the resident memory grow with the steps (beagle/host_allocator.py).

The rule is tested as a function, and end to end on the real console script: a real `beagle-pipeline train`
process starts itself again with jemalloc preloaded, trains the same floats as under glibc, and records the
malloc in run_config.json; BEAGLE_ALLOCATOR=system keeps glibc's.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from beagle.host_allocator import SYSTEM, find_jemalloc, loaded_allocator
from pipeline.commands.host_allocator import CHOICE_VARIABLE, restart_environment
from tests.tiny_store import build_tiny_store

BIN = str(Path(sys.executable).with_name("beagle-pipeline"))
JEMALLOC = find_jemalloc()
needs_jemalloc = pytest.mark.skipif(JEMALLOC is None or not sys.platform.startswith("linux"),
                                    reason="no jemalloc library (make install unpacks libjemalloc2 into .venv/lib)")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
ENV.pop(CHOICE_VARIABLE, None)
ENV.pop("LD_PRELOAD", None)


def _restart(argv0: str = "/opt/venv/bin/beagle-pipeline", environ: dict | None = None, **overrides):
    settings = {"device_type": "cpu", "loaded": SYSTEM, "jemalloc": "/opt/venv/lib/libjemalloc.so.2",
                "platform": "linux", **overrides}
    return restart_environment([argv0, "train", "--store", "s"], environ or {"PATH": "/bin"}, **settings)


def test_the_console_script_training_on_a_cpu_under_glibc_restarts_with_jemalloc_preloaded_first():
    env = _restart(environ={"PATH": "/bin", "LD_PRELOAD": "/lib/libother.so"})
    assert env == {"PATH": "/bin", "LD_PRELOAD": "/opt/venv/lib/libjemalloc.so.2:/lib/libother.so",
                   CHOICE_VARIABLE: "jemalloc"}


@pytest.mark.parametrize("case", [
    {"argv0": "/usr/bin/pytest"},                      # a Python process that imported the command
    {"argv0": "/repo/pipeline/commands/train.py"},     # torchrun -m pipeline.commands.train
    {"device_type": "cuda"},
    {"loaded": "tcmalloc"},                            # the user preloaded an allocator of their own
    {"jemalloc": None},                                # none installed
    {"platform": "darwin"},
    {"environ": {CHOICE_VARIABLE: "system"}},          # the user keeps the platform's malloc
    {"environ": {CHOICE_VARIABLE: "jemalloc"}},        # our own restart, whose preload did not take: no loop
])
def test_no_restart_outside_the_case_it_is_for(case):
    assert _restart(**case) is None


def test_the_malloc_in_use_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 43 /venv/lib/libjemalloc.so.2\n")
    assert loaded_allocator(str(maps)) == "jemalloc"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n7f04-7f05 rw-p 0 0 0\n")
    assert loaded_allocator(str(maps)) == SYSTEM
    assert loaded_allocator(str(tmp_path / "absent")) == SYSTEM


@needs_jemalloc
def test_a_preloaded_jemalloc_is_reported_and_the_platform_malloc_otherwise():
    probe = [sys.executable, "-c", "from beagle.host_allocator import loaded_allocator; print(loaded_allocator())"]
    assert subprocess.run(probe, env=ENV, capture_output=True, text=True, check=True).stdout.strip() == SYSTEM
    preloaded = subprocess.run(probe, env={**ENV, "LD_PRELOAD": JEMALLOC}, capture_output=True, text=True, check=True)
    assert preloaded.stdout.strip() == "jemalloc"


TRAIN = ["--batch-tokens", "80", "--window-size", "3", "--simulation-steps", "2", "--vocab-chunk", "128",
         "--stage1-epochs", "1", "--stage2-epochs", "1", "--device", "cpu", "--seed", "0", "--no-progress"]


def _train(store: str, out: Path, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run([BIN, "train", "--store", store, "--out", str(out), *TRAIN], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "platform's malloc" not in done.stderr, done.stderr[-3000:]  # neither case warns
    return done


@needs_jemalloc
@pytest.mark.slow
def test_train_from_the_console_script_runs_under_jemalloc_and_trains_the_same_floats(tmp_path):
    store = build_tiny_store(tmp_path / "store", num_samples=12)
    _train(store, tmp_path / "jemalloc", ENV)
    _train(store, tmp_path / "system", {**ENV, CHOICE_VARIABLE: "system"})

    runs = {name: json.loads((tmp_path / name / "run_config.json").read_text()) for name in ("jemalloc", "system")}
    assert runs["jemalloc"]["host_allocator"] == "jemalloc"
    assert runs["system"]["host_allocator"] == SYSTEM
    curves = {name: [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
              for name in runs}
    assert len(curves["jemalloc"]) >= 4 and curves["jemalloc"] == curves["system"]
    weights = [(tmp_path / name / "drafter" / "model.safetensors").read_bytes() for name in runs]
    assert weights[0] == weights[1]
