"""Joining or starting Ray for the driver-side jobs (`extract`, `regenerate`), and sizing their actor pool,
the same way for every job."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


def connect_ray(address: str | None, workers: int | None) -> bool:
    """Join `address` (or $RAY_ADDRESS), else start a local Ray sized to this machine.

    Returns True if we started it (the caller then shuts it down). A local Ray gets logical CPUs >= actors
    + 1, so that one CPU is left beside the model actors (extraction's tokenize tasks reserve none and run
    beside them either way).
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")  # `ray job submit` sets RAY_ADDRESS
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # address="local": always a fresh Ray of our own. A bare ray.init() would join any cluster already
        # running on this machine (another job's), and then refuse our num_cpus.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, (workers or 1) + 1),
                 include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    return True


def joined_cluster(address: str | None) -> bool:
    """True when the job runs on a cluster we joined, not on a Ray of our own on this machine."""
    return bool(address or os.environ.get("RAY_ADDRESS"))


def workers_use_gpus(address: str | None, num_gpus_per_worker: float) -> bool:
    """Whether a job's actors will hold GPUs, known before Ray starts: a joined cluster is taken to be GPU
    workers (what extraction clusters are), a Ray of our own has them when this machine has CUDA."""
    if joined_cluster(address):
        return True
    import torch

    return num_gpus_per_worker > 0 and torch.cuda.is_available()


def quiet_ray_loggers() -> None:
    """Keep the CLI's output to our own lines unless -v: Ray logs at INFO. Ray Data is left unimported (no
    job runs through it): importing it only to quiet it would add its modules to the driver's memory."""
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR)


@dataclass(frozen=True)
class ActorPool:
    """How many model actors a job runs and what each reserves, sized from the cluster Ray sees."""

    workers: int
    threads: int | None              # torch threads per actor; None leaves torch's default
    resources: dict[str, float]      # {"num_gpus": n} on a GPU cluster, else {"num_cpus": 1}
    kind: str                        # "GPU" or "CPU", for logs


def size_actor_pool(*, items: int, num_workers: int | None, num_gpus_per_worker: float, threads: int | None,
                    address: str | None) -> ActorPool:
    """One actor per `num_gpus_per_worker` GPUs (or `num_workers`), never more than `items`; on a local
    CPU-only Ray, one CPU actor whose threads split this machine's cores."""
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus and num_gpus_per_worker > gpus:
        raise ValueError(f"--num-gpus-per-worker {num_gpus_per_worker} exceeds the cluster's {gpus} GPU(s)")
    workers = min(num_workers or max(1, int(gpus // num_gpus_per_worker)), items)
    if threads is None and not gpus and not joined_cluster(address):
        threads = max(1, (os.cpu_count() or 1) // workers)
    resources = {"num_gpus": num_gpus_per_worker} if gpus else {"num_cpus": 1}
    return ActorPool(workers, threads, resources, "GPU" if gpus else "CPU")


@contextmanager
def ray_for_job(address: str | None, workers: int | None) -> Iterator[None]:
    """`connect_ray` for the block; a Ray this started is shut down after it, one joined is left running."""
    owned = connect_ray(address, workers)
    try:
        yield
    finally:
        if owned:
            import ray
            ray.shutdown()
