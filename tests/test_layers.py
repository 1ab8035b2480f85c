"""One-way layers, enforced by import-linter (contracts in .importlinter).

pipeline.store at the bottom (no torch, no Ray, no click/tqdm/matplotlib, nothing else of this project),
beagle above it (only pipeline.store from this project, never Ray, no click/tqdm/matplotlib), the
application layer (commands, extract, regenerate, demo, Ray launch, jobs) on top. Function-level imports count: a lazy `import torch` inside the store breaks it too.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("pipeline", "beagle", "jobs")


def _lint(root: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.is_file():
        pytest.fail(f"{LINT_IMPORTS} not found: install the dev extra (pip install -e '.[dev]'), "
                    "which brings import-linter")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_layers_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# Each probe adds one module to a copy of the tree, with an import its layer forbids (inside a function,
# where only a static analysis like import-linter's finds it).
PROBES = {
    "store imports torch": ("pipeline/store/_probe.py", "def f():\n    import torch\n"),
    "store imports the application": ("pipeline/store/_probe.py", "def f():\n    from pipeline.extract import cli\n"),
    "store imports beagle": ("pipeline/store/_probe.py", "def f():\n    import beagle.model\n"),
    "beagle imports ray": ("beagle/_probe.py", "def f():\n    import ray\n"),
    "beagle imports the application": ("beagle/_probe.py", "def f():\n    import pipeline.jobkit.ray_session\n"),
    "beagle imports click": ("beagle/_probe.py", "def f():\n    import click\n"),
    "store imports matplotlib": ("pipeline/store/_probe.py", "def f():\n    import matplotlib.pyplot\n"),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_forbidden_import_breaks_a_contract(tmp_path, probe):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    relative, source = PROBES[probe]
    (tmp_path / relative).write_text(source)
    result = _lint(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "BROKEN" in output and relative[:-3].replace("/", ".") in output, output
