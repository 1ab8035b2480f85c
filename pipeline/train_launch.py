"""`beagle-pipeline train --num-workers N [--address ...]`: the same training loop on N Ray Train workers.

Ray Train's TorchTrainer sets up the torch.distributed process group (gloo on CPU, nccl on GPU) on each
worker; every worker then calls `beagle.trainer.train`, which finds the group and runs DDP over disjoint
slices of each global batch (beagle.distributed). It lives in the application layer, not in `beagle`,
which never imports Ray; `pipeline.commands.train` imports it only when --num-workers is given: plain `train`
never loads Ray. Ray is joined or started by `pipeline.jobkit.ray_session.connect_ray`, like extract's.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from pipeline.jobkit.ray_session import connect_ray

log = logging.getLogger(__name__)


def _train_loop(cfg: dict[str, Any]) -> None:
    """Runs on each Ray Train worker."""
    import ray.train
    import ray.train.torch
    import torch

    from beagle.train_config import TrainConfig
    from beagle.trainer import train

    os.environ["LOCAL_RANK"] = str(ray.train.get_context().get_local_rank())
    config = TrainConfig.from_dict(cfg["config"])
    if config.device != "cpu" and torch.cuda.is_available():  # the GPU Ray assigned to this worker, by name
        config = dataclasses.replace(config, device=str(ray.train.torch.get_device()))
    result = train(cfg["stores"], cfg["run_dir"], config, resume=cfg["resume"], cache_dir=cfg["cache_dir"])
    final = result.final_metrics or {}
    ray.train.report({"steps": result.steps, "loss": final.get("loss")})


def launch(stores: list[str], run_dir: str | Path, config: Any, *, num_workers: int, address: str | None = None,
           resume: bool = False, cache_dir: str | None = None, cpus_per_worker: float = 1.0) -> dict[str, Any]:
    """Train on `num_workers` Ray Train workers; returns rank 0's final report {"steps", "loss"}.

    Joins `address` (or RAY_ADDRESS) when given, else starts a local Ray of our own (never a cluster
    that happens to run on this machine). Workers use one GPU each when
    the cluster has GPUs and config.device is not "cpu". `run_dir` must be storage that rank 0's node can
    write (on several nodes: a shared file system); the stores must be readable from every node (a shared
    path or an fsspec URL, with `cache_dir` for a local copy of the files read)."""
    if num_workers < 1:
        raise ValueError(f"--num-workers {num_workers} must be >= 1")
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = connect_ray(address, math.ceil(num_workers * cpus_per_worker))
    try:
        use_gpu = config.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        run_dir = Path(run_dir).resolve()
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"stores": [str(s) for s in stores], "run_dir": str(run_dir),
                               "config": config.to_dict(), "resume": resume, "cache_dir": cache_dir},
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                         resources_per_worker={"CPU": cpus_per_worker}),
            run_config=RunConfig(name=f"train-{time.strftime('%Y%m%d-%H%M%S')}", storage_path=str(run_dir / "ray")),
        )
        log.info("Ray Train: %d workers, use_gpu=%s", num_workers, use_gpu)
        result = trainer.fit()
        final = dict(result.metrics or {})
        metrics = run_dir / "metrics.jsonl"  # rank 0's log, when the driver shares its file system
        if not final and metrics.is_file():
            lines = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
            lines = [m for m in lines if m.get("split", "train") == "train"]  # not the validation lines
            last = lines[-1] if lines else {}
            final = {"steps": last.get("step"), "loss": last.get("loss")}
        return final
    finally:
        if started:
            ray.shutdown()
