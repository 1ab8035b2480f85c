"""The dependency floors are said once (pipeline/dependency_floors.py): setup.py installs from them, and
every command entry point refuses an installed package older than its floor with one line naming the fix, while
importing the library (as a Ray worker does) pays for no check."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from pipeline.dependency_floors import FLOORS, check_floors, requirements, too_old

REPO = Path(__file__).resolve().parent.parent


def test_the_installed_package_requires_exactly_the_floors_table():
    """The metadata pip recorded from setup.py (not setup.py's text): a floor typed into setup.py by hand, or
    one dropped from it, fails here."""
    from packaging.requirements import Requirement

    def parsed(specs):
        return sorted((r.name, tuple(sorted(r.extras)), str(r.specifier)) for r in map(Requirement, specs))

    installed = [r for r in importlib.metadata.requires("beagle-pipeline") if "extra ==" not in r]
    assert parsed(installed) == parsed(requirements())


def test_this_environment_meets_every_floor():
    check_floors()
    assert too_old() == []


def test_an_older_transformers_is_named_with_its_floor_and_the_fix():
    problems = too_old({"transformers": "4.45.2", "torch": "2.13.0+cpu", "zarr": "3.1.6"})
    assert len(problems) == 1
    assert problems[0].startswith("transformers 4.45.2 is older than beagle-pipeline needs (transformers>=5.0")
    assert 'pip install -U "transformers>=5.0"' in problems[0]
    assert too_old({"torch": "2.3.1"}) and not too_old({"torch": "2.4.0"}) and not too_old({"torch": "2.10.0"})
    assert set(FLOORS) >= {"torch", "transformers", "zarr", "blake3", "ml_dtypes"}


_OLD_TRANSFORMERS = ("import importlib.metadata as m\n"
                     "real = m.version\n"
                     "m.version = lambda name: '4.45.0' if name == 'transformers' else real(name)\n")


def test_a_command_with_an_old_dependency_fails_at_once_with_one_line():
    code = _OLD_TRANSFORMERS + "from pipeline.cli import main\nmain(['info', '--help'])\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: transformers 4.45.0 is older than beagle-pipeline needs"), \
        out.stderr


def test_a_job_entry_point_checks_too_and_a_library_import_does_not():
    job = _OLD_TRANSFORMERS + "import sys; sys.argv = ['jobs/extract.py', '--help']\nfrom jobs.extract import main\nmain()\n"
    out = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1 and "transformers 4.45.0 is older" in out.stderr, out.stderr
    library = _OLD_TRANSFORMERS + "import pipeline.store, beagle.registry\nprint('imported')\n"
    out = subprocess.run([sys.executable, "-c", library], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr
