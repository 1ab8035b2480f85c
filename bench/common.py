"""Shared by the bench scripts: demo paths, the result record the driver collects, machine facts.

Every bench script measures its figure side by side in one run, prints it, and with `--json PATH`
writes one record {figure, name, ratio, target, op, met, value_text, settings, why} that
`bench/run_all.py` turns into a row of docs/benchmarks.md.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = Path(os.environ.get("BEAGLE_DEMO_CACHE", ROOT / ".cache" / "demo"))
DEMO_MODEL = DEMO / "model"
DEMO_SHAREGPT = DEMO / "sharegpt" / "sharegpt.jsonl"
DEMO_QUESTIONS = DEMO / "mtbench" / "question.jsonl"


def cli(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    """Run `beagle-pipeline ARGS` in a subprocess (the real CLI, as a user would) and fail loudly."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-c", "from pipeline.cli import main; main(prog_name='beagle-pipeline')", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=quiet, text=True)
    if done.returncode != 0:
        tail = (done.stderr or "")[-2000:] if quiet else ""
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {done.returncode}:\n{tail}")
    return done


def require_demo() -> None:
    if not (DEMO_MODEL / "config.json").is_file():
        raise SystemExit(f"demo cache missing at {DEMO}; run `beagle-pipeline prepare-demo` first")


def record(figure: str, name: str, ratio: float, target: float, op: str, value_text: str,
           settings: dict[str, Any], why: str = "") -> dict[str, Any]:
    met = ratio >= target if op == ">=" else ratio <= target
    return {"figure": figure, "name": name, "ratio": ratio, "target": target, "op": op, "met": bool(met),
            "value_text": value_text, "settings": settings, "why": "" if met else why}


def emit(records: list[dict[str, Any]], json_path: str | None) -> None:
    for r in records:
        status = "met" if r["met"] else "MISSED"
        print(f"{r['figure']} {r['name']}: {r['ratio']:.3f} (target {r['op']} {r['target']}) {status}; {r['value_text']}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} CPU cores, {gpu}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads")


def tree_memory_mib(pid: int) -> tuple[float, float]:
    """(resident set, its anonymous part) of process `pid` and all its descendants, in MiB ((0, 0) once it has
    ended): what a benchmark's peak memory of a command means, dataloader workers and engine processes included.

    Why the anonymous part (heap, tensors, stacks: the resident set less the pages of files and shared memory,
    psutil's `rss - shared` from /proc/PID/statm; 0 where psutil has no `shared`, off Linux): the resident set
    also counts the pages of memory-mapped files a process has touched (our trainer maps the feature store),
    clean page cache the kernel drops under pressure; two trainers that read their data differently compare
    fairly on what they allocate."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    rss = anon = 0
    for process in processes:
        try:
            info = process.memory_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        anon += info.rss - info.shared if hasattr(info, "shared") else 0
    return rss / 2**20, anon / 2**20


class PeakRss:
    """The peak resident set of a running process tree (its children included), sampled on a thread every
    `interval` seconds from `with PeakRss(process)` until the process exits; read `.mib` (resident set) and
    `.anon_mib` (its anonymous part, `tree_memory_mib`) after the block."""

    def __init__(self, process: subprocess.Popen, interval: float = 0.5) -> None:
        self.process, self.interval, self.mib, self.anon_mib = process, interval, 0.0, 0.0
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while self.process.poll() is None:
            rss, anon = tree_memory_mib(self.process.pid)
            self.mib, self.anon_mib = max(self.mib, rss), max(self.anon_mib, anon)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRss":
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sampler.join()


def run_measured(command: list[str], env: dict[str, str], what: str, timeout: float = 7200) -> tuple[str, float, float]:
    """Run `command` to its end, sampling its process tree's resident memory every 0.5 s meanwhile.

    Returns (stdout, wall seconds, peak MiB); a failing command stops the benchmark with the tail of its stderr,
    since a figure from a half-run would mean nothing."""
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.perf_counter()
    with PeakRss(child) as peak:
        out, err = child.communicate(timeout=timeout)
        seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"{what} failed:\n{err[-3000:]}")
    return out, seconds, peak.mib
