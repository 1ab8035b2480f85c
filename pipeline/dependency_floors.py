"""The oldest version of each dependency that the code really needs, said once: setup.py builds its
install_requires from this table, and importing `pipeline` (which every command and every store reader
does) refuses an installed package older than its floor with one line naming the fix, instead of an
AttributeError deep inside a run.

Only the standard library is imported here: setup.py runs this file before anything is installed.
Each floor names what needs it; raise one when the code starts using something newer.
"""
from __future__ import annotations

import importlib.metadata
import re

# distribution name -> (floor, what needs it, upper bound or "")
FLOORS: dict[str, tuple[str, str, str]] = {
    "torch": ("2.4", "torch.uint16 views of bf16 bit patterns and their .numpy() (only 2.13 is tested here)", ""),
    "transformers": ("5.0", "the per-layer cache (cache_utils.DynamicLayer), from_pretrained(dtype=), the "
                            "conversion_mapping the head reader follows", ""),
    "datasets": ("2.20", "load_from_disk inputs", ""),
    "pyarrow": ("15", "memory-mapped IPC streams", ""),
    "zarr": ("3.0", "the v3 format and sharding codec the store writes", "4"),
    "google-crc32c": ("1.5", "the shard index checksum zarr expects", ""),
    "numpy": ("1.26", "", ""),
    "blake3": ("1.0", "the store's file checksums", ""),
    "ml_dtypes": ("0.5", "bfloat16 and float8_e4m3fn numpy dtypes of stored states", ""),
    "fsspec": ("2024.2", "object-store URLs", ""),
    "ijson": ("3.2", "JSON array inputs, streamed (beagle/records/json_arrays.py: basic_parse, get_backend)", ""),
    "ray": ("2.30", "Ray Data and actors for extract and regenerate", ""),
    "click": ("8.1", "the command line", ""),
    "safetensors": ("0.4", "head and drafter files", ""),
    "tqdm": ("4.66", "progress bars", ""),
    "matplotlib": ("3.8", "curves and acceptance plots", ""),
}
EXTRAS = {"ray": "[data]"}  # pip extras of a requirement


def requirements() -> list[str]:
    """install_requires, as setup.py passes them to pip."""
    return [f"{name}{EXTRAS.get(name, '')}>={floor}" + (f",<{upper}" if upper else "")
            for name, (floor, _, upper) in FLOORS.items()]


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string ("2.13.0+cpu" -> (2, 13, 0), "5.0.0rc1" -> (5, 0, 0))."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def too_old(installed: dict[str, str] | None = None) -> list[str]:
    """One line per installed dependency older than its floor; packages that are not installed are pip's
    business (a store reader may well run without torch)."""
    problems = []
    for name, (floor, why, _) in FLOORS.items():
        if installed is not None:
            version = installed.get(name)
        else:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = None
        if version is not None and _release(version) < _release(floor):
            problems.append(f"{name} {version} is older than beagle-pipeline needs ({name}>={floor}"
                            + (f": {why}" if why else "") + f"); pip install -U \"{name}>={floor}\"")
    return problems


def check_floors() -> None:
    """Refuse to run on a dependency older than its floor (ImportError, one line per package)."""
    problems = too_old()
    if problems:
        raise ImportError("; ".join(problems))


def refuse_old_dependencies() -> None:
    """The command entry points' check: a dependency older than its floor stops the command with one line
    naming the fix (exit status 1), before any work. Libraries and Ray workers never pay for it."""
    problems = too_old()
    if problems:
        raise SystemExit("error: " + "; ".join(problems))
