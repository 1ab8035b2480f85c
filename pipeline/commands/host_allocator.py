"""`train` on a CPU starts itself again under jemalloc, where one is installed.

An allocator is chosen when a process starts (LD_PRELOAD), so the only way to give a running `train` a
malloc whose memory stays flat as batch shapes change (beagle/host_allocator.py says why glibc's does not)
is to start the same command again with it preloaded: os.execve keeps the process id, the arguments and the
terminal, so a supervisor, a kill test or a shell sees one process. Only the console script does this, never
a Python process that imported the command (pytest, a notebook), and only once: BEAGLE_ALLOCATOR marks the
second start. BEAGLE_ALLOCATOR=system keeps the platform's malloc.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from beagle.host_allocator import SYSTEM, find_jemalloc, loaded_allocator

logger = logging.getLogger(__name__)

CHOICE_VARIABLE = "BEAGLE_ALLOCATOR"   # "system": keep the platform's malloc; "jemalloc": set on our restart
CONSOLE_SCRIPT = "beagle-pipeline"
INSTALL_HINT = ("install jemalloc (Debian/Ubuntu: apt install libjemalloc2; `make install` unpacks it into "
                ".venv/lib) for flat memory, or set BEAGLE_ALLOCATOR=system to keep this malloc and this note quiet")


def restart_environment(argv: list[str], environ: Mapping[str, str], *, device_type: str, loaded: str,
                        jemalloc: str | None, platform: str = sys.platform) -> dict[str, str] | None:
    """The environment to start this command again with (LD_PRELOAD=jemalloc), or None to go on as it is.

    Only on Linux, for training on the CPU, from the `beagle-pipeline` console script, when the process runs
    on the platform's malloc, BEAGLE_ALLOCATOR is unset (neither the user's "system" nor our own mark of a
    restart) and a jemalloc library is found."""
    if not (platform.startswith("linux") and device_type == "cpu" and argv
            and Path(argv[0]).name == CONSOLE_SCRIPT and loaded == SYSTEM
            and not environ.get(CHOICE_VARIABLE) and jemalloc):
        return None
    preload = ":".join(filter(None, [jemalloc, environ.get("LD_PRELOAD", "")]))
    return {**environ, "LD_PRELOAD": preload, CHOICE_VARIABLE: "jemalloc"}


def train_under_jemalloc(device_type: str) -> None:
    """Start this `train` again under jemalloc where that helps and can be done (see restart_environment);
    otherwise return, saying once what the user can do about a malloc whose memory grows."""
    loaded = loaded_allocator()
    jemalloc = find_jemalloc() if loaded == SYSTEM else None
    environment = restart_environment(sys.argv, os.environ, device_type=device_type, loaded=loaded,
                                      jemalloc=jemalloc)
    if environment is not None:
        logger.info("starting again with %s preloaded (flat host memory on a CPU; %s=system to keep this "
                    "malloc)", jemalloc, CHOICE_VARIABLE)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], environment)
    choice = os.environ.get(CHOICE_VARIABLE, "")
    if choice == "jemalloc" and loaded == SYSTEM:
        logger.warning("%s=jemalloc but jemalloc is not loaded (LD_PRELOAD=%r could not be preloaded); training "
                       "on the platform's malloc", CHOICE_VARIABLE, os.environ.get("LD_PRELOAD", ""))
    elif (loaded == SYSTEM and not choice and device_type == "cpu" and sys.platform.startswith("linux")
          and Path(sys.argv[0]).name == CONSOLE_SCRIPT):
        logger.warning("training on the CPU with the platform's malloc, whose resident memory grows with the "
                       "steps (about 2x by step 400, docs/training.md, 'Host memory on a CPU'); %s", INSTALL_HINT)
