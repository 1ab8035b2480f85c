"""Keeping account of what the forward actors report about the shards they commit (`Forwarded`), and how
their time overlapped.

The actors are fed by the job kit's dispatcher (pipeline.jobkit.dispatch), two shards in flight on each:
`ShardExtractor` runs two calls on two threads, its forward under a lock, so one shard is written while
the next one is forwarded; `write_overlap_seconds` measures the write time that hid from the device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

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
