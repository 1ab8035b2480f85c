"""The regeneration job: stream prompts -> Ray actors answer whole chunks -> one JSONL, committed atomically.

Layout next to `--out answers.jsonl`:
  answers.jsonl                conversations `{"id", "messages", "source", "regenerated"}` (text records:
                               `{"id", "text", ...}`, the text and its continuation), input order;
                               `extract --data answers.jsonl` reads it as is
  answers.jsonl.manifest.json  what made it: target fingerprint, settings, input hashes, counts, the engine
  answers.jsonl.rejects.jsonl  records that could not be used, each with file, record and reason
  answers.jsonl.partial/       work in progress: one file per finished chunk; removed on success
  answers.jsonl.lock           held (flock) while a job writes; a second job into the same --out is refused

Chunks are cut from the inputs in order, so they depend only on inputs and settings: a rerun after a crash
keeps the finished chunks (same settings) and redoes the rest. The output file appears only once it is
complete (written aside, then renamed), and only after its manifest, so a file with the final name and a
matching manifest is never partial.

Memory: the driver never holds the inputs. One pass counts them (the identity hashes every input and its
record count, and is needed before `.partial/` is claimed); the second streams them in chunks to the
actors, two at most in flight per actor, and stops reading while the actors are full (the job kit's
chunk plan and dispatcher, pipeline.jobkit). The output is joined from the chunk files one at a time.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from beagle.devices import DTYPES
from beagle.precision import AUTO_DTYPE, resolve_target_dtype
from beagle.errors import refuse_non_finite
from beagle.host_memory import peak_rss_mib
from beagle.target_facts import read_target_facts
from beagle.target_model import check_weights_match, weight_files
from beagle.records import DEFAULT_MAX_RECORD_BYTES
from pipeline.jobkit.dispatch import ActorDispatcher, ActorSpec
from pipeline.jobkit.identity import identity_sha256
from pipeline.jobkit.outputs import output_lock, write_lines
from pipeline.jobkit.plan import chunked, run_chunks
from pipeline.jobkit.progress import Progress
from pipeline.jobkit.ray_session import ray_for_job
from pipeline.jobkit.record_stream import InputChangedError, InputScan, check_unchanged, refuse_changed
from pipeline.store import atomic
from pipeline.jobkit.rejects import count_reasons, format_reasons, sorted_rejects
from pipeline.jobkit.target import load_tokenizer, target_fingerprint
from pipeline.jobkit.ray_session import joined_cluster, workers_use_gpus
from pipeline.regenerate.generation import GenerateConfig
from pipeline.regenerate.prompts import scan_prompts, stream_prompts
from pipeline.jobkit.vllm_process import check_vllm_options, engine_actor_pool, engine_identity
from pipeline.jobkit.vllm_process import engine_facts as run_engine_facts

logger = logging.getLogger(__name__)

REGENERATE_VERSION = 1


@dataclass(frozen=True)
class RegenerateConfig:
    generate: GenerateConfig
    data: tuple[str, ...]
    out: str
    limit: int | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # larger input records are rejected as too_large
    chunk_size: int = 128            # conversations per actor task: the unit of work and of resume
    num_workers: int | None = None   # None: one per GPU, or one CPU actor
    num_gpus_per_worker: float = 1.0
    address: str | None = None       # None: start a local Ray
    overwrite: bool = False


@dataclass
class RegenerateSummary:
    out: str
    conversations: int = 0
    turns: int = 0
    generated_tokens: int = 0
    unfinished_turns: int = 0
    dropped_turns: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    chunks: int = 0
    chunks_resumed: int = 0
    seconds: float = 0.0
    generate_seconds: float = 0.0   # wall time of the actor pool over the chunks done in this run
    tokens_this_run: int = 0
    driver_peak_rss_mib: float = 0.0  # the driver's peak resident memory (bounded: inputs are streamed)
    state: str = "new"              # new | resumed | complete (nothing to do)
    engine: str = "hf"              # what generated: "hf" or "vllm 0.32.0"

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by_reason.values())

    def lines(self) -> list[str]:
        rate = self.tokens_this_run / self.generate_seconds if self.generate_seconds else 0.0
        lines = [f"wrote {self.out}: {self.conversations:,} conversations, {self.turns:,} answers, "
                 f"{self.generated_tokens:,} generated tokens",
                 f"answers cut at --max-new-tokens: {self.unfinished_turns:,}; later turns skipped "
                 f"(prompt over --max-prompt-length): {self.dropped_turns:,}"]
        if self.rejected:
            lines.append(f"rejected {self.rejected:,} records ({format_reasons(self.rejected_by_reason)}); see "
                         f"{rejects_path(self.out)}")
        if self.chunks_resumed:
            lines.append(f"resumed: {self.chunks_resumed} of {self.chunks} chunks kept from an earlier run")
        if self.generate_seconds:
            lines.append(f"generation ({self.engine}): {rate:,.0f} tokens/s over {self.generate_seconds:.1f}s, loading the target "
                         f"included (total {self.seconds:.1f}s)")
        if self.driver_peak_rss_mib:
            lines.append(f"driver: {self.driver_peak_rss_mib:,.0f} MiB peak resident memory")
        return lines


def manifest_path(out: str) -> Path:
    return Path(out + ".manifest.json")


def rejects_path(out: str) -> Path:
    return Path(out + ".rejects.jsonl")


def partial_dir(out: str) -> Path:
    return Path(out + ".partial")


def _check(config: RegenerateConfig) -> None:
    """Everything that can be refused before reading inputs or loading the model, as one-line errors."""
    generate = config.generate
    refuse_non_finite(generate)
    if not config.data:
        raise ValueError("--data: give at least one input file")
    if "://" in config.out:
        raise ValueError(f"--out {config.out}: regenerate writes a local JSONL file; copy it to object storage after")
    if not config.out.endswith((".jsonl", ".ndjson")):
        raise ValueError(f"--out {config.out}: name the output file *.jsonl (extract reads it by its suffix)")
    weight_files(generate.model_path)
    target = read_target_facts(generate.model_path, trust_remote_code=generate.trust_remote_code)
    check_weights_match(generate.model_path, target.hidden_size, target.vocab_size, target.num_hidden_layers)
    if generate.dtype not in DTYPES:
        raise ValueError(f"--dtype {generate.dtype}: use one of {sorted(DTYPES)}")
    for name in ("max_new_tokens", "max_prompt_length", "batch_size"):
        if getattr(generate, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(generate, name)}: must be at least 1")
    if config.chunk_size < 1:
        raise ValueError(f"--chunk-size {config.chunk_size}: must be at least 1")
    if generate.temperature < 0 or not 0 < generate.top_p <= 1:
        raise ValueError(f"--temperature {generate.temperature} / --top-p {generate.top_p}: need temperature >= 0 "
                         "and 0 < top-p <= 1")
    _check_engine(config, target.max_position_embeddings)


def _check_engine(config: RegenerateConfig, max_positions: int | None) -> None:
    generate = config.generate
    check_vllm_options(generate.engine, generate.vllm, num_gpus_per_worker=config.num_gpus_per_worker)
    if generate.engine != "vllm":
        return
    if max_positions and generate.max_prompt_length >= max_positions:
        # vLLM refuses a prompt longer than the model's positions (the whole round would fail); transformers
        # would run past them. An answer reaching the limit is cut there and counted as unfinished.
        raise ValueError(f"--max-prompt-length {generate.max_prompt_length}: the target has "
                         f"{max_positions} positions, and vLLM takes no prompt that long; give at most "
                         f"{max_positions - 1}")


def engine_facts(config: RegenerateConfig) -> dict[str, Any]:
    """What generates, the manifest's `generated_by` (pipeline/jobkit/vllm_process.py `engine_facts`)."""
    generate = config.generate
    return run_engine_facts(generate.engine, generate.vllm, generate.model_path,
                            trust_remote_code=generate.trust_remote_code, joined_cluster=joined_cluster(config.address))


def _check_chat_template(config: RegenerateConfig, scan: InputScan) -> None:
    """Conversations need the target's chat template; refused here, before any Ray worker starts, when the
    tokenizer has none (a base model), naming the first such record and the input a base model takes."""
    chat = scan.first_conversation
    if chat is None:
        return
    tokenizer = load_tokenizer(config.generate.model_path, trust_remote_code=config.generate.trust_remote_code)
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise ValueError(f"--model {config.generate.model_path}: the tokenizer has no chat template, so the "
                         f"conversation at {chat['source']} record {chat['index']} cannot be asked; give a base "
                         "model {\"text\": ...} records to continue, or add a chat_template to tokenizer_config.json")


def identity(config: RegenerateConfig, scan: InputScan, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the output depends on; a rerun with the same identity resumes or finds the work done.

    The engine counts when it is vLLM (name and version: its kernels round differently from transformers'),
    not how it is spread over devices; the transformers engine is left out, so older outputs stay valid."""
    generate = asdict(config.generate)
    for machine_only in ("model_path", "device", "threads", "trust_remote_code", "engine", "vllm"):
        generate.pop(machine_only)
    target = target_fingerprint(config.generate.model_path, config.generate.dtype,
                                trust_remote_code=config.generate.trust_remote_code)
    facts = {"version": REGENERATE_VERSION, "target": target,
             "generate": generate, "chunk_size": config.chunk_size, "limit": config.limit,
             "sources": scan.sources}
    if config.max_record_bytes != DEFAULT_MAX_RECORD_BYTES:  # recorded only when set: older outputs stay valid
        facts["max_record_bytes"] = config.max_record_bytes
    if engine is not None and engine_identity(engine) is not None:
        facts["engine"] = engine_identity(engine)
    return facts


def _chunk_path(work: Path, chunk: int) -> Path:
    return work / f"chunk-{chunk:06d}.jsonl"


_CHUNK_NAME = re.compile(r"chunk-(\d{6})\.jsonl")


def _committed_chunks(work: Path) -> dict[int, Path]:
    """The chunks an earlier run finished (each file was written aside and renamed: present is whole)."""
    found = (_CHUNK_NAME.fullmatch(path.name) for path in work.iterdir())
    return {int(match.group(1)): work / match.group(0) for match in found if match}


def _prepare_work_dir(config: RegenerateConfig, facts_hash: str) -> Path:
    """The .partial folder for this identity: kept when it matches, refused (or cleared) when it does not."""
    work = partial_dir(config.out)
    settings = work / "identity.txt"
    if work.exists():
        same = settings.is_file() and settings.read_text().strip() == facts_hash
        if not same:
            if not config.overwrite:
                raise ValueError(f"{work} holds unfinished work from other inputs or settings; rerun that command "
                                 "to finish it, or pass --overwrite to discard it")
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not settings.is_file():
        atomic.write_text(settings, facts_hash + "\n")
    return work


def resolve_dtype(config: RegenerateConfig) -> RegenerateConfig:
    """`--dtype auto` made a dtype before anything depends on it (the identity, the actors): bf16 where the
    actors run it natively (a local GPU, a joined cluster, which is taken to be GPUs, or this CPU's AMX or
    AVX512-BF16), else fp32. Said once in the log, and the identity records the dtype used."""
    generate = config.generate
    if generate.dtype != AUTO_DTYPE:
        return config
    if generate.device is not None:
        on_gpu = generate.device.startswith("cuda")
    else:
        on_gpu = workers_use_gpus(config.address, config.num_gpus_per_worker)
    dtype = resolve_target_dtype(generate.dtype, on_gpu=on_gpu)
    logger.info("regenerate: --dtype auto is %s here (%s)", dtype, "a GPU or native bf16" if dtype == "bfloat16"
                else "a CPU without AMX or AVX512-BF16, where bf16 is emulated")
    return replace(config, generate=replace(generate, dtype=dtype))


def run_regenerate(config: RegenerateConfig, *, progress: Progress | None = None) -> RegenerateSummary:
    """The whole job; rerun the same command to resume after a crash."""
    started = time.perf_counter()
    config = resolve_dtype(config)
    _check(config)
    scan = scan_prompts(list(config.data), limit=config.limit, max_record_bytes=config.max_record_bytes)
    _check_chat_template(config, scan)
    engine = engine_facts(config)
    with output_lock(config.out):  # held for the whole job: two jobs never interleave chunks of one output
        return _run_locked(config, scan, engine, progress, started)


def _run_locked(config: RegenerateConfig, scan: InputScan, engine: dict[str, Any], progress: Progress | None,
                started: float) -> RegenerateSummary:
    facts = identity(config, scan, engine)
    facts_hash = identity_sha256(facts)
    out, manifest = Path(config.out), manifest_path(config.out)
    summary = RegenerateSummary(out=config.out, engine=" ".join(
        [engine["name"]] + ([engine["version"]] if engine["name"] != "hf" else [])))
    if out.exists():
        made = json.loads(manifest.read_text()) if manifest.is_file() else {}
        if made.get("identity_sha256") == facts_hash and not config.overwrite:
            for key, value in made["counts"].items():
                setattr(summary, key, value)
            summary.state = "complete"
            summary.seconds = time.perf_counter() - started
            summary.driver_peak_rss_mib = peak_rss_mib()
            return summary
        if not config.overwrite:
            raise ValueError(f"--out {config.out} exists and was not made by this command with these inputs and "
                             "settings; pass --overwrite to replace it")
        manifest.unlink(missing_ok=True)  # --overwrite: the old output must never pass for the new one
        out.unlink()
    if not scan.records and not scan.rejected_by_reason:
        raise ValueError(f"--data {', '.join(map(str, config.data))}: no records in the input; nothing to "
                         "regenerate")
    if not scan.records:
        raise ValueError(f"all {sum(scan.rejected_by_reason.values())} records were rejected "
                         f"({format_reasons(scan.rejected_by_reason)}); nothing to regenerate; check the input format")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = _prepare_work_dir(config, facts_hash)
    committed = _committed_chunks(work)
    summary.chunks = math.ceil(scan.records / config.chunk_size)
    summary.state = "resumed" if committed else "new"
    stream = stream_prompts(list(config.data), scan, limit=config.limit, max_record_bytes=config.max_record_bytes)
    written: list[int] = []  # chunks committed in this run

    def on_result(result: dict[str, Any]) -> None:
        atomic.write_text(_chunk_path(work, result["chunk"]), result["lines"])
        written.append(result["chunk"])
        summary.tokens_this_run += result["tokens"]
        if progress is not None:
            progress.advance(result["conversations"], result["tokens"], this_run=True)

    def kept(index: int, records: list, path: Path) -> None:
        if progress is not None:
            progress.advance(len(records), 0, this_run=False)

    if progress is not None:
        progress.start(scan.records)
    with ExitStack() as ray_session:  # Ray is joined (or started) only if some chunk is left to answer
        def start_actors() -> ActorDispatcher:
            ray_session.enter_context(ray_for_job(config.address, config.num_workers))
            return _dispatcher(config, summary.chunks - len(committed), on_result, log_dir=str(work))

        try:
            run = run_chunks(chunked(stream, config.chunk_size), committed=committed, start_actors=start_actors,
                             on_kept=kept,
                             before_dispatch=lambda: refuse_changed(scan, job="regenerate", output="the output"))
            check_unchanged(scan, stream, job="regenerate", output="the output")
        except InputChangedError:  # what this run answered was read from bytes that were not hashed
            for chunk in written:
                _chunk_path(work, chunk).unlink(missing_ok=True)
            if not _committed_chunks(work):
                shutil.rmtree(work)  # so that the rerun, with the final inputs, meets no unfinished work
            raise
    summary.chunks_resumed = len(run.kept)
    summary.generate_seconds = run.seconds
    _assemble(config, stream.rejects, {**facts, "generated_by": engine}, facts_hash, summary.chunks, work, summary)
    shutil.rmtree(work)
    summary.seconds = time.perf_counter() - started
    summary.driver_peak_rss_mib = peak_rss_mib()
    return summary


def _dispatcher(config: RegenerateConfig, pending: int, on_result: Any, *, log_dir: str | None = None) -> ActorDispatcher:
    """The generation actors for at most `pending` chunks: one per GPU (per --num-gpus-per-worker), or
    --num-workers, or one CPU actor using all cores. Two chunks in flight on each, run one after the other
    (generate is not thread-safe): the next chunk is on the actor when one finishes.

    With --engine vllm an actor is one vLLM engine (pipeline/jobkit/vllm_process.py `engine_actor_pool`)."""
    from pipeline.regenerate.generation import ChunkAnswerer

    generate = config.generate
    pool, vllm = engine_actor_pool(generate.engine, generate.vllm, items=pending, num_workers=config.num_workers,
                                   num_gpus_per_worker=config.num_gpus_per_worker, threads=generate.threads,
                                   address=config.address)
    generate = replace(generate, model_path=os.path.abspath(generate.model_path), threads=pool.threads, vllm=vllm)
    return ActorDispatcher(pool, ActorSpec(ChunkAnswerer, (generate,), method="answer", per_actor=2, concurrency=1,
                                           label=f"generate ({generate.engine})", kwargs={"log_dir": log_dir},
                                           close_method="close"),
                           on_result)


def _chunk_texts(work: Path, chunks: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, parsed) of every chunk file in chunk order, one file in memory at a time."""
    for k in range(chunks):
        for text in _chunk_path(work, k).read_text(encoding="utf-8").split("\n"):
            if text:
                yield text, json.loads(text)


def _assemble(config: RegenerateConfig, read_rejects: list[dict[str, Any]], facts: dict[str, Any], facts_hash: str,
              chunks: int, work: Path, summary: RegenerateSummary) -> None:
    """Join the chunk files in order into the output, its rejects file and its manifest (manifest first).
    Two passes over the chunk files: the counts the manifest holds, then the output, streamed."""
    answered_rejects = []
    for _, line in _chunk_texts(work, chunks):
        if "reject" in line:
            answered_rejects.append(line["reject"])
            continue
        stats = line["regenerated"]
        summary.conversations += 1
        summary.turns += sum(m["role"] == "assistant" for m in line["messages"]) if "messages" in line else 1
        summary.generated_tokens += stats["tokens"]
        summary.unfinished_turns += stats["unfinished_turns"]
        summary.dropped_turns += stats["dropped_turns"]
    rejects = sorted_rejects(config.data, read_rejects, answered_rejects)
    summary.rejected_by_reason = count_reasons(rejects)
    if rejects:
        atomic.write_text(rejects_path(config.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))
    elif rejects_path(config.out).exists():
        rejects_path(config.out).unlink()
    counts = {key: getattr(summary, key) for key in ("conversations", "turns", "generated_tokens", "unfinished_turns",
                                                     "dropped_turns", "rejected_by_reason")}
    atomic.write_text(manifest_path(config.out), json.dumps(
        {"identity_sha256": facts_hash, **facts, "counts": counts,
         "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")
    write_lines(Path(config.out), (text + "\n" for text, line in _chunk_texts(work, chunks) if "reject" not in line))
