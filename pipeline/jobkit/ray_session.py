"""Joining or starting Ray for the driver-side jobs (`extract`, `regenerate`), the same way for both."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any


def connect_ray(address: str | None, workers: int | None) -> bool:
    """Join `address` (or $RAY_ADDRESS), else start a local Ray sized to this machine.

    Returns True if we started it (the caller then shuts it down). A local Ray gets logical CPUs >= actors
    + 1, so that Ray Data's read tasks (regenerate's input) never wait behind the model actors; extraction's
    tokenize tasks reserve no CPU and run beside the actors either way.
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


def configure_ray_data() -> None:
    """How our jobs run Ray Data: without its progress bars (they would fight with the CLI's tqdm), with the
    whole actor pool loaded before work starts, and without its no-progress timeout."""
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")  # read when ray.data is first imported
    import ray.data
    context = ray.data.DataContext.get_current()
    if context.enable_progress_bars:
        context.enable_progress_bars = False
    context.print_on_execution_start = False
    # Start work only when the whole actor pool holds its model, so work spreads over all actors
    # instead of queueing on the first one to finish loading.
    context.wait_for_min_actors_s = 3600
    # One shard (or chunk) is one task, and it may rightly run for a long time: 256 long samples of a large
    # target on a CPU, or an actor that other work starves. Ray Data's guard (no output for 30 min) would
    # then kill the whole job with its own traceback; it did, in the scaling study. Our progress is per
    # shard, each committed as it comes, so a rerun resumes whatever stops.
    context.execution_no_progress_timeout_s = -1


def quiet_ray_loggers(*, ray_data: bool = True) -> None:
    """Keep the CLI's output to our own lines unless -v: Ray logs at INFO, and Ray Data every execution.

    `ray_data=False` (extraction, which feeds its own actors) leaves `ray.data` unimported: importing it only
    to quiet it would add its modules to the driver's memory."""
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        if ray_data:
            import ray.data  # noqa: F401 - configures its loggers on import; quiet them afterwards
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR)


@dataclass(frozen=True)
class ActorPool:
    """How many model actors a job runs and what each reserves, sized from the cluster Ray sees."""

    workers: int
    threads: int | None              # torch threads per actor; None leaves torch's default
    resources: dict[str, float]      # {"num_gpus": n} on a GPU cluster, else {"num_cpus": 1}
    kind: str                        # "GPU" or "CPU", for logs

    def map_batches(self, dataset: Any, actor: type, **constructor_kwargs: Any) -> Any:
        """`dataset` mapped one row at a time through `actor`, one task in flight per actor."""
        import ray.data

        compute = ray.data.ActorPoolStrategy(size=self.workers, max_tasks_in_flight_per_actor=1,
                                             max_concurrent_calls_per_actor=1, enable_true_multi_threading=False)
        return dataset.map_batches(actor, batch_size=1, **self.resources, compute=compute,
                                   fn_constructor_kwargs=constructor_kwargs)


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

