"""Where a machine's CPU time went during a block of work, by kind of process (Linux, from /proc).

On a small machine the processes around the work (a Ray driver, Ray's own services, task workers) take
cores from it. `cpu_accounting()` samples every process's CPU seconds while the block runs (processes that
exit in between keep their last sample) and sorts them into kinds, so a bench can print the profile that
explains a gap instead of guessing it.
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
RAY_SERVICES = ("raylet", "gcs_server", "dashboard", "DashboardAgent", "RuntimeEnvAgent", "log_monitor", "monitor",
                "autoscaler")


@dataclass
class CpuAccount:
    """CPU seconds by kind over the block, and the block's wall time."""
    wall_seconds: float = 0.0
    cores: int = os.cpu_count() or 1
    seconds: Counter = field(default_factory=Counter)

    @property
    def idle_seconds(self) -> float:
        """Core-seconds nobody used (the machine's capacity less every process's CPU time)."""
        return max(0.0, self.wall_seconds * self.cores - sum(self.seconds.values()))

    def summary(self) -> dict[str, float]:
        return {**{kind: round(value, 1) for kind, value in self.seconds.most_common()},
                "idle": round(self.idle_seconds, 1), "capacity": round(self.wall_seconds * self.cores, 1)}


def _process_times() -> dict[int, tuple[str, float]]:
    """{pid: (name or Ray's process title, CPU seconds)} of every process this user can read."""
    times = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                stat = handle.read()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                title = handle.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        times[int(entry)] = (title or stat[stat.index("(") + 1:stat.rindex(")")],
                             (int(fields[11]) + int(fields[12])) / _TICKS)  # utime + stime
    return times


def kind_of(pid: int, title: str, actor_title: str) -> str:
    """"driver" (this process), "actor" (titles holding `actor_title`), "Ray services", "Ray workers"
    (task workers, idle or not) or "other"."""
    if pid == os.getpid():
        return "driver"
    if actor_title in title:
        return "actor"
    if any(name in title for name in RAY_SERVICES):
        return "Ray services"
    if title.startswith("ray::"):
        return "Ray workers"
    return "other"


@contextmanager
def cpu_accounting(actor_title: str = "ShardExtractor", interval: float = 0.5) -> Iterator[CpuAccount]:
    """Within the block, account every process's CPU seconds by `kind_of` (sampled every `interval` s)."""
    account = CpuAccount()
    if not os.path.isdir("/proc"):
        yield account
        return
    before, last = _process_times(), {}
    titles: dict[int, set[str]] = {}  # every title a pid showed: a Ray worker renames itself per task
    stop = threading.Event()

    def record(times: dict[int, tuple[str, float]]) -> None:
        last.update(times)
        for pid, (title, _) in times.items():
            titles.setdefault(pid, set()).add(title)

    def sample() -> None:
        while not stop.wait(interval):
            record(_process_times())

    sampler = threading.Thread(target=sample, name="cpu-accounting", daemon=True)
    start = time.perf_counter()
    sampler.start()
    try:
        yield account
    finally:
        stop.set()
        sampler.join()
        record(_process_times())
        account.wall_seconds = time.perf_counter() - start
        for pid, (_, seconds) in last.items():
            spent = seconds - before.get(pid, ("", 0.0))[1]
            if spent > 0:
                kinds = {kind_of(pid, title, actor_title) for title in titles[pid]}
                kind = next((k for k in ("driver", "actor", "Ray services", "Ray workers") if k in kinds), "other")
                account.seconds[kind] += spent
