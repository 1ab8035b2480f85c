"""Feeding shards to the forward actors as they are formed, with a bounded number in flight, and keeping
account of what the actors report (`Forwarded`).

The actors are persistent Ray actors (`ShardExtractor`), started on the first shard that needs a forward
(a run whose shards are all committed, or whose records are all rejected, starts none). Each actor holds
at most `per_actor` shards: with two, one shard is written while the next one is forwarded (the actor runs
two calls on two threads, its forward under a lock). When every actor is full, `submit` waits for a shard
to commit: the back-pressure that stops the driver reading and tokenizing ahead of the forward.

Why not Ray Data's actor pool, as before: Ray Data has no source that the driver feeds as it goes.
`from_items` takes a list built first (which is how every record and every shard used to sit in the
driver's memory at once), and file sources read in parallel tasks, which cannot draw shard boundaries:
those depend on how many records before them survived reading and tokenizing, a running count only the
driver keeps. A few actors fed by hand keep what the pool gave us: a killed actor is restarted and its
shards are redone (`max_restarts`, `max_task_retries`), and a write overlaps the next forward.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.extract.forward import ForwardConfig
from pipeline.store.format import StoreEncoding
from pipeline.ray_session import ActorPool

logger = logging.getLogger(__name__)


@dataclass
class Forwarded:
    """What the forward actors reported about the shards they committed in this run."""

    infos: list[dict] = field(default_factory=list)  # the committed shards' infos, in commit order
    actor_pids: set[int] = field(default_factory=set)  # forward actors that committed shards in this run
    actor_nodes: dict[int, str] = field(default_factory=dict)  # shard index -> Ray node id that wrote it
    actor_seconds: float = 0.0  # summed over shards: forward + write inside the actors
    actor_forward_seconds: float = 0.0  # summed over shards: the forward alone
    actor_spans: list[tuple[int, float, float, float]] = field(default_factory=list)  # pid, forward start/end, commit
    seconds: float = 0.0  # from the first shard handed to an actor to the last one committed

    def record(self, result: dict[str, Any]) -> dict:
        """Account for one shard an actor finished (`ShardExtractor.extract`'s result) and return its info;
        raise the OSError the actor met writing it."""
        info = result["info"]
        if "os_error" in info:
            failed = info["os_error"]
            raise OSError(failed["errno"], failed["strerror"], failed["filename"])
        index, pid = int(result["shard_index"]), int(result["pid"])
        self.infos.append(info)
        self.actor_pids.add(pid)
        self.actor_nodes[index] = str(result["node"])
        logger.info("shard %d committed by pid %d on node %s", index, pid, self.actor_nodes[index])
        self.actor_seconds += float(result["seconds"])
        self.actor_forward_seconds += float(result["forward_seconds"])
        self.actor_spans.append((pid, *(float(t) for t in result["spans"])))
        return info


def write_overlap_seconds(spans: list[tuple[int, float, float, float]]) -> float:
    """How long shards were being written while the same actor already forwarded the next one: the write
    time the overlap hid from the device. `spans`: (actor pid, forward start, forward end, committed)."""
    hidden = 0.0
    for pid in {span[0] for span in spans}:
        mine = sorted(span[1:] for span in spans if span[0] == pid)
        for (_, written_from, written_to), (next_start, next_end, _) in zip(mine, mine[1:]):
            hidden += max(0.0, min(written_to, next_end) - max(written_from, next_start))
    return hidden


def actor_busy_seconds(spans: list[tuple[int, float, float, float]]) -> float:
    """Each actor's wall time from its first forward to its last commit, summed over actors: the time the
    actors spent on shards, without their start (process, model load) or the driver's own work."""
    busy = 0.0
    for pid in {span[0] for span in spans}:
        mine = [span for span in spans if span[0] == pid]
        busy += max(span[3] for span in mine) - min(span[1] for span in mine)
    return busy


class ShardDispatcher:
    """Hands shards to forward actors, `per_actor` at most on each, and records every shard they finish in
    `forwarded`; `on_commit(info)` is called for each committed shard (progress)."""

    def __init__(self, pool: ActorPool, config: ForwardConfig, store_url: str, *, per_actor: int = 2,
                 encoding: StoreEncoding | None = None, on_commit: Callable[[dict], None] | None = None) -> None:
        self.pool = pool
        self.config = config
        self.store_url = store_url
        self.encoding = encoding or StoreEncoding(config.dtype)
        self.per_actor = per_actor
        self.on_commit = on_commit
        self.forwarded = Forwarded()
        self.actors: list[Any] = []
        self.in_flight: dict[Any, int] = {}  # result ref -> actor index
        self.started = 0.0

    def _start(self) -> None:
        import ray

        from pipeline.extract.actor import ShardExtractor

        # A killed actor is restarted and the shards it held are run again (their writes are atomic, so a
        # shard it had committed is only written once more, with the same bytes).
        remote = ray.remote(ShardExtractor).options(max_restarts=-1, max_task_retries=-1,
                                                    max_concurrency=self.per_actor, **self.pool.resources)
        self.started = time.perf_counter()
        self.actors = [remote.remote(self.config, self.store_url, self.encoding) for _ in range(self.pool.workers)]
        logger.info("forward: %d %s actor(s), %d shard(s) in flight on each", self.pool.workers, self.pool.kind,
                    self.per_actor)

    def submit(self, shard_index: int, samples: list[dict[str, Any]]) -> None:
        """Give one shard to the least busy actor, first waiting for a shard to finish if all are full."""
        if not self.actors:
            self._start()
        self._collect(wait=False)
        while len(self.in_flight) >= self.per_actor * len(self.actors):
            self._collect(wait=True)
        load = [0] * len(self.actors)
        for actor in self.in_flight.values():
            load[actor] += 1
        actor = load.index(min(load))
        self.in_flight[self.actors[actor].extract.remote(shard_index, samples)] = actor

    def finish(self) -> Forwarded:
        """Wait for every shard in flight; what the actors did."""
        while self.in_flight:
            self._collect(wait=True)
        if self.actors:
            self.forwarded.seconds = time.perf_counter() - self.started
        return self.forwarded

    def close(self) -> None:
        """Stop the actors (a failed job must not keep writing shards after the driver has given up)."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.in_flight = [], {}

    def _collect(self, *, wait: bool) -> None:
        """Record every finished shard; with `wait`, block until at least one has finished."""
        import ray

        if not self.in_flight:
            return
        done, _ = ray.wait(list(self.in_flight), num_returns=1 if wait else len(self.in_flight),
                           timeout=None if wait else 0)
        for ref in done:
            del self.in_flight[ref]
            info = self.forwarded.record(ray.get(ref))
            if self.on_commit is not None:
                self.on_commit(info)
