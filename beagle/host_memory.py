"""This process's peak resident memory: what `eval` reports on a CPU and `extract` reports for its driver.

One reader, so that both commands mean the same number (the kernel's high-water mark, VmHWM)."""
from __future__ import annotations

import resource
import sys


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (VmHWM; ru_maxrss where there is no /proc)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
