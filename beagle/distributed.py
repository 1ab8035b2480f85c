"""Data-parallel plumbing: the same training loop on N ranks (torchrun or Ray Train), DDP, no Ray here.

Why the run matches a single-process run: every rank builds the same batch plan (it depends only on seed
and epoch), takes a contiguous slice of each global batch's samples (disjoint reads of the memory-mapped
store), pads to the global batch's longest sample and draws key noise for the whole global batch, keeping
its own rows, so all generators stay in step and each row gets the noise the single-process run gives it.
Loss denominators (summed row weights per depth) are summed over ranks, so the per-rank losses add up to
the single-process loss; DDP averages gradients, so each rank back-propagates world_size x its loss.
Only rank 0 writes (metrics, checkpoints, export).
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "torchrun"  # who set up the process group: "torchrun" (env), or "ray" (Ray Train)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistContext()


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; "
                         "launch with torchrun or Ray Train, which set it") from exc


@contextlib.contextmanager
def session(device_name: str) -> Iterator[DistContext]:
    """The rank's context for one training run.

    Uses a process group that is already set up (Ray Train's), else joins the one torchrun describes in
    the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; nccl on CUDA, gloo on CPU)
    and leaves it at the end. Without either: a single process."""
    created = False
    if _initialized():
        ctx = DistContext(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0), launcher="ray")
    elif _env_int("WORLD_SIZE", 1) > 1:
        local_rank = _env_int("LOCAL_RANK", 0)
        use_cuda = torch.cuda.is_available() and device_name != "cpu"
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        created = True
        ctx = DistContext(dist.get_rank(), dist.get_world_size(), local_rank)
        log.info("joined process group: rank %d of %d (%s)", ctx.rank, ctx.world_size, dist.get_backend())
    else:
        ctx = SINGLE
    try:
        yield ctx
    finally:
        if created:
            dist.destroy_process_group()


def rank_device(device: torch.device, ctx: DistContext) -> torch.device:
    """One GPU per rank under data parallelism: `cuda` becomes cuda:LOCAL_RANK.

    An explicit `cuda:N` is refused under torchrun (it would put every rank on GPU N) and kept under Ray
    Train, whose launcher names the GPU Ray assigned to each worker (`pipeline/train_launch.py`: Ray sets the
    worker's visible devices, so cuda:LOCAL_RANK need not be among them)."""
    if not ctx.enabled or device.type != "cuda":
        return device
    if device.index is None:
        return torch.device("cuda", ctx.local_rank)
    if ctx.launcher == "torchrun":
        raise ValueError(f"--device {device} under torchrun would put all {ctx.world_size} ranks on GPU "
                         f"{device.index}; pass --device cuda: each rank then takes cuda:LOCAL_RANK")
    return device


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def shard_bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous slice [lo, hi) of a global batch's rows for `rank`; slice sizes differ by at most one."""
    base, extra = divmod(rows, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def global_sum(t: Tensor) -> Tensor:
    """t summed over ranks (a detached copy); t itself outside a process group. Used for loss
    denominators, which are constants of the batch (no gradient flows through them)."""
    if not _initialized() or dist.get_world_size() == 1:
        return t
    out = t.detach().clone()
    dist.all_reduce(out)
    return out


class _LossModule(torch.nn.Module):
    """Routes the stage loss through forward(), where DDP prepares its gradient all-reduce."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, loss_fn: Callable[..., Any], *args: Any) -> Any:
        return loss_fn(self.model, *args)


def loss_runner(model: torch.nn.Module, ctx: DistContext) -> Callable[..., Any]:
    """A callable `(loss_fn, batch, offset, settings, generator) -> LossResult`: plain call in one
    process, through DistributedDataParallel (which also broadcasts rank 0's weights) on several."""
    if not ctx.enabled:
        return lambda loss_fn, *args: loss_fn(model, *args)
    from torch.nn.parallel import DistributedDataParallel

    # broadcast_buffers=False: the only buffers are the frozen embedding and heads, identical on every rank;
    # re-broadcasting them at every forward would move gigabytes per step at 8B scale.
    return DistributedDataParallel(_LossModule(model), device_ids=None, broadcast_buffers=False)


def no_sync(run_loss: Callable[..., Any], *, last: bool) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and backward under gradient accumulation: DDP skips its gradient
    all-reduce until the `last` micro-batch, whose backward reduces the accumulated gradients once."""
    no_sync_of = getattr(run_loss, "no_sync", None)
    return contextlib.nullcontext() if last or no_sync_of is None else no_sync_of()


@dataclass(frozen=True)
class StepStats:
    loss: float
    token_loss: float
    regression_loss: float
    correct: list[int]
    count: list[int]
    tokens: int
    grad_norm: float | None = None


def step_stats(result: Any, tokens: int, ctx: DistContext, grad_norm: torch.Tensor | None = None) -> StepStats:
    """The global batch's loss terms, accuracy counts and tokens (sums over ranks) for metrics, and the
    gradient norm (the same on every rank after DDP's all-reduce, so not summed).

    The step's one host synchronisation: everything is gathered into one tensor first."""
    device = result.loss.device
    values = torch.cat([
        torch.stack([result.loss.detach(), result.token_loss.detach(), result.regression_loss.detach()]).double(),
        result.correct.double(), result.count.double(),
        torch.tensor([tokens], dtype=torch.float64, device=device)])                   # [3 + 2k + 1]
    if ctx.enabled:
        dist.all_reduce(values)
    if grad_norm is not None:
        values = torch.cat([values, grad_norm.detach().double().reshape(1).to(device)])
    values = values.cpu().tolist()
    norm = values.pop() if grad_norm is not None else None
    k = result.correct.numel()
    ints = [int(round(c)) for c in values[3:]]
    return StepStats(values[0], values[1], values[2], ints[:k], ints[k:2 * k], ints[-1], norm)
