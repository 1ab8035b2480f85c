"""Preparing the demo cache once: the converted target model, ShareGPT conversations, MT-Bench questions.

Layout of the cache folder (default `.cache/demo` in the repository, or `$BEAGLE_CACHE/demo`):

    prepare.json                  the prep manifest, written last: its presence means the cache is whole
    model/                        bf16 safetensors checkpoint + tokenizer with chat template
    sharegpt/sharegpt.jsonl       the complete ShareGPT conversations, one per line
    mtbench/question.jsonl        MT-Bench's 80 questions
    code/humaneval.jsonl          HumanEval's 164 problems as prompts (category humaneval)
    math/gsm8k.jsonl              100 GSM8K test questions, from GSM-Symbolic's templates (category gsm8k)

Every run builds into a sibling `<cache>.incomplete-*` folder and renames it into place, so an interrupted
run never leaves a half cache behind. A component whose inputs and settings are unchanged is moved over
(hard-linked) from the previous cache rather than rebuilt; when nothing changed the run does nothing at all.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.demo import mtbench, packages, sharegpt, task_sets
from pipeline.store.atomic import commit_directory
from pipeline.store.hashing import sha256_local_file

logger = logging.getLogger(__name__)

CACHE_FORMAT = "beagle-demo-cache/1"
MANIFEST_NAME = "prepare.json"


class Progress(Protocol):
    """Where preparation reports what it is doing; the CLI shows it as progress bars."""

    def start(self, label: str, total: int | None) -> None: ...
    def advance(self, amount: int) -> None: ...
    def finish(self, message: str) -> None: ...


class LogProgress:
    """The default reporter: one log line per finished step."""

    def start(self, label: str, total: int | None) -> None:
        logger.info("%s ...", label)

    def advance(self, amount: int) -> None:
        pass

    def finish(self, message: str) -> None:
        logger.info("%s", message)


PROMPT_SETS = {"code": "code/humaneval.jsonl", "math": "math/gsm8k.jsonl"}  # in the cache, by component


@dataclass(frozen=True)
class DemoCache:
    """The paths inside a prepared demo cache."""

    root: Path

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def sharegpt_path(self) -> Path:
        return self.root / "sharegpt" / "sharegpt.jsonl"

    @property
    def questions_path(self) -> Path:
        return self.root / "mtbench" / "question.jsonl"

    def prompt_set(self, name: str) -> Path:
        """The prompt records of a packaged set: "code" (HumanEval) or "math" (GSM8K), PROMPT_SETS."""
        return self.root / PROMPT_SETS[name]

    def read_manifest(self) -> dict | None:
        """The prep manifest, or None when the cache is absent or was never completed."""
        try:
            return json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None


@dataclass(frozen=True)
class PrepareConfig:
    """What to prepare. `num_conversations=None` keeps every complete ShareGPT conversation."""

    cache_dir: Path
    num_conversations: int | None = None
    model_dtype: str = "bfloat16"


@dataclass(frozen=True)
class PrepareResult:
    cache: DemoCache
    manifest: dict
    built: tuple[str, ...]   # components converted in this run
    reused: tuple[str, ...]  # components carried over unchanged

    @property
    def did_nothing(self) -> bool:
        return not self.built and not self.reused


def default_cache_dir() -> Path:
    """`$BEAGLE_CACHE/demo` if set, else `.cache/demo` in the repository (or the current folder)."""
    if os.environ.get("BEAGLE_CACHE"):
        return Path(os.environ["BEAGLE_CACHE"]) / "demo"
    repo = Path(__file__).resolve().parents[2]
    base = repo if (repo / "setup.py").is_file() else Path.cwd()
    return base / ".cache" / "demo"


def prepare_demo(config: PrepareConfig, *, progress: Progress | None = None,
                 sources: Mapping[str, packages.PackagedFile] | None = None) -> PrepareResult:
    """Bring the demo cache at `config.cache_dir` up to date; see the module docstring.

    `sources` replaces the packaged input files per component ("model", "sharegpt", "mtbench"); the
    default is the pinned PyPI packages.

    Raises packages.MissingPackageError (one line with the pip command) when an input package is missing,
    and ValueError when the folder exists but is not a demo cache.
    """
    if config.num_conversations is not None and config.num_conversations < 1:
        raise ValueError(f"--num-conversations must be at least 1, got {config.num_conversations}")
    progress = progress or LogProgress()
    cache = DemoCache(Path(config.cache_dir).resolve())
    specs = {**_COMPONENT_SOURCES, **(sources or {})}
    located = {name: packages.locate(spec) for name, spec in specs.items()}
    wanted = {name: _component_key(name, located[name], config) for name in specs}

    cache.root.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache.root.parent / f".{cache.root.name}.lock"):
        old = _existing_manifest(cache)
        old_components = (old or {}).get("components", {})
        stale = [name for name in wanted if old_components.get(name, {}).get("key") != wanted[name]]
        if old is not None and not stale:
            return PrepareResult(cache=cache, manifest=old, built=(), reused=())

        staging = Path(tempfile.mkdtemp(prefix=f"{cache.root.name}.incomplete-", dir=cache.root.parent))
        staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            new_cache = DemoCache(staging)
            components = {}
            for name in wanted:
                if name in stale:
                    started = time.perf_counter()
                    record = _BUILDERS[name](new_cache, located[name], config, progress)
                    record["seconds"] = round(time.perf_counter() - started, 1)
                else:
                    # Hard links: no copy, and the old cache stays whole until the swap.
                    shutil.copytree(cache.root / _COMPONENT_DIRS[name], staging / _COMPONENT_DIRS[name],
                                    copy_function=_link_or_copy)
                    record = old_components[name]
                components[name] = {"key": wanted[name], **{k: v for k, v in record.items() if k != "key"}}
            manifest = {"format": CACHE_FORMAT,
                        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "components": components}
            new_cache.manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            commit_directory(staging, cache.root, replace=True)  # the old cache is moved aside, then deleted
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    reused = tuple(name for name in wanted if name not in stale)
    return PrepareResult(cache=cache, manifest=manifest, built=tuple(stale), reused=reused)


def _existing_manifest(cache: DemoCache) -> dict | None:
    if not cache.root.exists():
        return None
    manifest = cache.read_manifest()
    if manifest is None:
        if any(cache.root.iterdir()):
            raise ValueError(f"{cache.root} exists but is not a demo cache (no {MANIFEST_NAME}): remove it or "
                             f"pass another --cache-dir")
        return None
    if manifest.get("format") != CACHE_FORMAT:
        logger.info("%s has cache format %r; rebuilding as %s", cache.root, manifest.get("format"), CACHE_FORMAT)
        return {"components": {}}
    return manifest


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Serialise concurrent preparations of the same cache (a second one waits, then finds it ready)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _component_key(name: str, source: packages.LocatedFile, config: PrepareConfig) -> dict:
    """What a component depends on; a change to any of it rebuilds that component."""
    key = {"distribution": source.spec.distribution, "version": source.installed_version,
           "file": source.spec.relative_path, "bytes": source.path.stat().st_size}
    if name == "model":
        key["dtype"] = config.model_dtype
    if name == "sharegpt":
        key["num_conversations"] = config.num_conversations
    return key


def _source_record(source: packages.LocatedFile, progress: Progress) -> dict:
    progress.start(f"sha256 of {source.path.name}", None)
    digest = sha256_local_file(source.path)
    progress.finish(f"sha256 {digest[:16]}… {source.path.name}")
    return {"distribution": source.spec.distribution, "version": source.installed_version,
            "path": str(source.path), "bytes": source.path.stat().st_size, "sha256": digest}


def _build_model(cache: DemoCache, source: packages.LocatedFile, config: PrepareConfig,
                 progress: Progress) -> dict:
    import torch

    record = {"source": _source_record(source, progress), "path": "model"}
    progress.start(f"converting {source.path.name} to a {config.model_dtype} checkpoint", None)
    converted = _gguf().convert_gguf(source.path, cache.model_dir, dtype=getattr(torch, config.model_dtype))
    progress.finish(f"model: {converted.architecture}, {converted.num_parameters / 1e6:.1f}M parameters, "
                    f"d={converted.hidden_size}, {converted.num_hidden_layers} layers -> {cache.model_dir.name}/")
    record.update(architecture=converted.architecture, num_parameters=converted.num_parameters,
                  hidden_size=converted.hidden_size, num_hidden_layers=converted.num_hidden_layers,
                  vocab_size=converted.vocab_size, dtype=converted.dtype,
                  has_chat_template=converted.has_chat_template)
    return record


def _build_sharegpt(cache: DemoCache, source: packages.LocatedFile, config: PrepareConfig,
                    progress: Progress) -> dict:
    record = {"source": _source_record(source, progress), "path": "sharegpt/sharegpt.jsonl"}
    cache.sharegpt_path.parent.mkdir(parents=True, exist_ok=True)
    decoded, kept = sharegpt.DecodeStats(), sharegpt.FilterStats()
    progress.start(f"decoding {source.path.name}", source.path.stat().st_size)
    conversations = sharegpt.iter_conversations(source.path, limit=config.num_conversations,
                                                decode_stats=decoded, filter_stats=kept,
                                                on_bytes=progress.advance)
    written = sharegpt.write_jsonl(conversations, cache.sharegpt_path)
    cut = f"file cut after record {decoded.records}" if decoded.truncated else "file complete"
    progress.finish(f"sharegpt: {written} conversations ({cut}) -> {record['path']}")
    record.update(conversations=written, decoded_records=decoded.records, truncated=decoded.truncated,
                  unreadable_records=decoded.unreadable, skipped=kept.skipped)
    return record


def _build_mtbench(cache: DemoCache, source: packages.LocatedFile, config: PrepareConfig,
                   progress: Progress) -> dict:
    record = {"source": _source_record(source, progress), "path": "mtbench/question.jsonl"}
    cache.questions_path.parent.mkdir(parents=True, exist_ok=True)
    questions = mtbench.load_questions(source.path)
    mtbench.write_questions(questions, cache.questions_path)
    progress.finish(f"mt-bench: {len(questions)} questions -> {record['path']}")
    record.update(questions=len(questions))
    return record


def _prompt_set_builder(label: str, relative: str, load: Callable[[Path], list[dict]]):
    """A builder writing the prompt records `load` reads from a packaged file to `relative` in the cache."""
    def build(cache: DemoCache, source: packages.LocatedFile, config: PrepareConfig, progress: Progress) -> dict:
        record = {"source": _source_record(source, progress), "path": relative}
        written = task_sets.write_records(load(source.path), cache.root / relative)
        progress.finish(f"{label}: {written} prompts -> {relative}")
        record.update(questions=written)
        return record
    return build


_build_code = _prompt_set_builder("humaneval", PROMPT_SETS["code"], task_sets.load_humaneval)
_build_math = _prompt_set_builder("gsm8k", PROMPT_SETS["math"], task_sets.load_gsm8k_questions)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _gguf():
    """gguf_convert imports transformers; only the model step needs it."""
    from pipeline.demo import gguf_convert
    return gguf_convert


_COMPONENT_SOURCES = {"model": packages.SMOLLM2_GGUF, "sharegpt": packages.SHAREGPT_JSON,
                      "mtbench": packages.MTBENCH_QUESTIONS, "code": packages.HUMANEVAL_PROBLEMS,
                      "math": packages.GSM8K_TEMPLATES}
_COMPONENT_DIRS = {"model": "model", "sharegpt": "sharegpt", "mtbench": "mtbench", "code": "code", "math": "math"}
_BUILDERS: dict[str, Callable[[DemoCache, packages.LocatedFile, PrepareConfig, Progress], dict]] = {
    "model": _build_model, "sharegpt": _build_sharegpt, "mtbench": _build_mtbench, "code": _build_code,
    "math": _build_math}
