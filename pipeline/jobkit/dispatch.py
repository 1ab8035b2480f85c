"""Feeding chunks to model actors as the driver forms them, a bounded number in flight on each.

The actors are persistent Ray actors of a plain Python class (`ActorSpec.cls`: it loads the model in
`__init__`; `ActorSpec.method(chunk_index, items)` does one chunk and returns its result as data). They are
started on the first chunk that needs work (a run whose chunks are all committed starts none). Each actor
holds at most `per_actor` chunks: with two, the next chunk is already on the actor when one finishes
(extraction's actor even writes one while it forwards the next). When every actor is full, `submit` waits
for a result: the back-pressure that stops the driver reading its inputs ahead of the actors, so what it
holds is bounded by actors x per_actor x the chunk size, not by the inputs.

Why not Ray Data's actor pool: it has no source that the driver feeds as it goes. `from_items` takes a
list built first (every record in the driver's memory at once, then pickled into rows), and file sources
read in parallel tasks, which cannot draw chunk boundaries that depend on a running count only the driver
keeps (extraction's shards: the samples that survived tokenizing). Actors fed by hand keep what the pool
gave: a killed actor is restarted and its chunks are redone (`max_restarts`, `max_task_retries`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.jobkit.ray_session import ActorPool

logger = logging.getLogger(__name__)

CLOSE_SECONDS = 120.0  # how long `close` waits for the actors' own close (a vLLM engine's shutdown)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@dataclass(frozen=True)
class ActorSpec:
    """Which actor a job runs and how: `cls(*args)` once per actor, then `method(chunk_index, items)` per
    chunk. `concurrency`: calls an actor runs at once (threads); 1 queues the second chunk behind the first."""

    cls: type
    args: tuple[Any, ...] = ()
    method: str = "__call__"
    per_actor: int = 2
    concurrency: int = 1
    label: str = "work"  # for logs: "forward", "generate"
    kwargs: dict[str, Any] = field(default_factory=dict)
    # called on each actor before it is killed, so that what it started outside Ray (a vLLM worker process
    # and its scratch folder) ends cleanly: Ray's kill ends the actor's child processes with it, abruptly
    close_method: str | None = None


class ActorDispatcher:
    """Hands chunks to `pool.workers` actors of `spec`, `spec.per_actor` at most on each, and passes every
    result to `on_result` (in the order they finish) as it collects it."""

    def __init__(self, pool: ActorPool, spec: ActorSpec, on_result: Callable[[Any], None]) -> None:
        self.pool = pool
        self.spec = spec
        self.on_result = on_result
        self.actors: list[Any] = []
        self.in_flight: dict[Any, int] = {}  # result ref -> actor index
        self.started = 0.0
        self.seconds = 0.0  # from the first chunk handed to an actor to the last result collected

    def _start(self) -> None:
        import ray

        # A killed actor is restarted and the chunks it held are run again (each chunk's commit is atomic,
        # so one it had committed is only written once more, with the same bytes).
        remote = ray.remote(self.spec.cls).options(max_restarts=-1, max_task_retries=-1,
                                                   max_concurrency=self.spec.concurrency, **self.pool.resources)
        self.started = time.perf_counter()
        self.actors = [remote.remote(*self.spec.args, **self.spec.kwargs) for _ in range(self.pool.workers)]
        logger.info("%s: %d %s actor(s), %d chunk(s) in flight on each", self.spec.label, self.pool.workers,
                    self.pool.kind, self.spec.per_actor)

    def submit(self, chunk_index: int, items: Any) -> None:
        """Give one chunk to the least busy actor, first waiting for a result if all are full."""
        if not self.actors:
            self._start()
        self._collect(wait=False)
        while len(self.in_flight) >= self.spec.per_actor * len(self.actors):
            self._collect(wait=True)
        load = [0] * len(self.actors)
        for actor in self.in_flight.values():
            load[actor] += 1
        actor = load.index(min(load))
        self.in_flight[getattr(self.actors[actor], self.spec.method).remote(chunk_index, items)] = actor

    def finish(self) -> float:
        """Wait for every chunk in flight; the seconds the actors worked (first chunk to last result)."""
        while self.in_flight:
            self._collect(wait=True)
        if self.actors:
            self.seconds = time.perf_counter() - self.started
        return self.seconds

    def close(self) -> None:
        """Stop the actors (a failed job must not keep committing chunks after the driver has given up),
        after their `close_method` where the spec has one and no chunk is in flight (at most CLOSE_SECONDS;
        a failed or interrupted job does not wait behind a chunk, its actors are killed as they are)."""
        import ray

        if self.spec.close_method and self.actors and not self.in_flight:
            closing = [getattr(actor, self.spec.close_method).remote() for actor in self.actors]
            try:
                ray.get(closing, timeout=CLOSE_SECONDS)
            except Exception as error:  # noqa: BLE001 - the actors are killed next whatever happened
                logger.warning("%s: closing the actors: %s", self.spec.label, _first_line(error))
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.in_flight = [], {}

    def _collect(self, *, wait: bool) -> None:
        """Pass on every finished result; with `wait`, block until at least one has finished."""
        import ray

        if not self.in_flight:
            return
        done, _ = ray.wait(list(self.in_flight), num_returns=1 if wait else len(self.in_flight),
                           timeout=None if wait else 0)
        for ref in done:
            del self.in_flight[ref]
            self.on_result(_get(ref))


def _get(ref: Any) -> Any:
    """`ray.get`, except that an actor's `BeagleError` (a user's problem its message explains: an engine that
    cannot start the target) is raised as itself, for the command's one-line report, not inside Ray's
    traceback of the remote call."""
    import ray

    from beagle.errors import BeagleError

    try:
        return ray.get(ref)
    except ray.exceptions.RayError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, BeagleError):
            raise cause from None
        raise
