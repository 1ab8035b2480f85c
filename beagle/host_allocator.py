"""Which malloc serves this process, and where jemalloc is, for training on a CPU.

Why it matters: on a CPU the drafter's activations are host tensors whose shapes change with every batch
([rows, longest sample]). glibc's malloc keeps what they free in its heap, raising its mmap threshold as it
goes, and the trainer's resident set grows with the steps: 1.9 GiB at step 18, 4.7 GiB at step 400 on the
peer run's store, where jemalloc holds 2.5-2.6 GiB at the same speed (docs/benchmarks.md, "Where our
trainer's memory goes"). An allocator is chosen when the process starts (LD_PRELOAD), so `train` starts
itself again under jemalloc where one is found (pipeline/commands/host_allocator.py); this module only finds
and reports.
"""
from __future__ import annotations

import ctypes.util
import glob
import os
import sys
from pathlib import Path

# malloc implementations recognised in /proc/self/maps, by the file name of their shared library.
KNOWN_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
SYSTEM = "system"


def loaded_allocator(maps: str = "/proc/self/maps") -> str:
    """The malloc this process runs on: "jemalloc", "tcmalloc" or "mimalloc" when one of their libraries
    is mapped, else "system" (glibc's, or whatever the platform has; also where there is no /proc)."""
    try:
        text = Path(maps).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return SYSTEM
    for line in text.splitlines():
        name = os.path.basename(line.rsplit(None, 1)[-1]) if line.strip() else ""
        for allocator in KNOWN_ALLOCATORS:
            if name.startswith(f"lib{allocator}"):
                return allocator
    return SYSTEM


def find_jemalloc() -> str | None:
    """The jemalloc shared library to preload, or None: first this Python environment's lib/ (where
    `make install` unpacks one), then conda's, then the system's (found through ldconfig: Debian's and
    Ubuntu's libjemalloc2, or another distribution's package). A path, or a bare soname that the dynamic
    loader resolves itself."""
    prefixes = [sys.prefix, os.environ.get("CONDA_PREFIX", "")]
    for prefix in filter(None, prefixes):
        found = sorted(glob.glob(os.path.join(prefix, "lib", "libjemalloc.so*")))
        if found:
            return found[0]
    return ctypes.util.find_library("jemalloc")
