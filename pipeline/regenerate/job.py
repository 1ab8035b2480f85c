"""The regeneration job: read prompts -> Ray actors answer whole chunks -> one JSONL, committed atomically.

Layout next to `--out answers.jsonl`:
  answers.jsonl                conversations `{"id", "messages", "source", "regenerated"}` (text records:
                               `{"id", "text", ...}`, the text and its continuation), input order;
                               `extract --data answers.jsonl` reads it as is
  answers.jsonl.manifest.json  what made it: target fingerprint, settings, input hashes, counts
  answers.jsonl.rejects.jsonl  records that could not be used, each with file, record and reason
  answers.jsonl.partial/       work in progress: one file per finished chunk; removed on success
  answers.jsonl.lock           held (flock) while a job writes; a second job into the same --out is refused

Chunks are cut from the inputs in order, so they depend only on inputs and settings: a rerun after a crash
keeps the finished chunks (same settings) and redoes the rest. The output file appears only once it is
complete (written aside, then renamed), and only after its manifest, so a file with the final name and a
matching manifest is never partial.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from beagle.devices import DTYPES
from beagle.target_facts import read_target_facts
from beagle.target_model import check_weights_match, weight_files
from pipeline.extract.chat import load_tokenizer
from pipeline.extract.forward import target_fingerprint
from pipeline.extract.inputs import DEFAULT_MAX_RECORD_BYTES
from pipeline.store import atomic
from pipeline.store.file_lock import exclusive_lock
from pipeline.ray_session import connect_ray, configure_ray_data, size_actor_pool
from pipeline.regenerate.generation import Answered, GenerateConfig
from pipeline.regenerate.prompts import PromptRead, PromptRecord, read_prompts

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


class Progress(Protocol):
    def start(self, conversations: int) -> None: ...

    def advance(self, conversations: int, tokens: int) -> None: ...


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
    state: str = "new"              # new | resumed | complete (nothing to do)

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
            lines.append(f"rejected {self.rejected:,} records ({_reasons(self.rejected_by_reason)}); see "
                         f"{rejects_path(self.out)}")
        if self.chunks_resumed:
            lines.append(f"resumed: {self.chunks_resumed} of {self.chunks} chunks kept from an earlier run")
        if self.generate_seconds:
            lines.append(f"generation: {rate:,.0f} tokens/s over {self.generate_seconds:.1f}s, loading the target "
                         f"included (total {self.seconds:.1f}s)")
        return lines


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))


def manifest_path(out: str) -> Path:
    return Path(out + ".manifest.json")


def rejects_path(out: str) -> Path:
    return Path(out + ".rejects.jsonl")


def partial_dir(out: str) -> Path:
    return Path(out + ".partial")


def _check(config: RegenerateConfig) -> None:
    """Everything that can be refused before reading inputs or loading the model, as one-line errors."""
    generate = config.generate
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


def _check_chat_template(config: RegenerateConfig, read: PromptRead) -> None:
    """Conversations need the target's chat template; refused here, before any Ray worker starts, when the
    tokenizer has none (a base model), naming the first such record and the input a base model takes."""
    chat = next((record for record in read.records if not record.text), None)
    if chat is None:
        return
    tokenizer = load_tokenizer(config.generate.model_path, trust_remote_code=config.generate.trust_remote_code)
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise ValueError(f"--model {config.generate.model_path}: the tokenizer has no chat template, so the "
                         f"conversation at {chat.source} record {chat.index} cannot be asked; give a base model "
                         "{\"text\": ...} records to continue, or add a chat_template to tokenizer_config.json")


def identity(config: RegenerateConfig, read: PromptRead) -> dict[str, Any]:
    """What the output depends on; a rerun with the same identity resumes or finds the work done."""
    generate = asdict(config.generate)
    for machine_only in ("model_path", "device", "threads", "trust_remote_code"):
        generate.pop(machine_only)
    target = target_fingerprint(config.generate.model_path, config.generate.dtype,
                                trust_remote_code=config.generate.trust_remote_code)
    facts = {"version": REGENERATE_VERSION, "target": target,
             "generate": generate, "chunk_size": config.chunk_size, "limit": config.limit,
             "sources": read.sources}
    if config.max_record_bytes != DEFAULT_MAX_RECORD_BYTES:  # recorded only when set: older outputs stay valid
        facts["max_record_bytes"] = config.max_record_bytes
    return facts


def _identity_hash(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _chunk_path(work: Path, chunk: int) -> Path:
    return work / f"chunk-{chunk:06d}.jsonl"


def _chunk_lines(answered: list[Answered]) -> str:
    """A finished chunk: one line per record, the output conversation or its reject."""
    lines = []
    for result in answered:
        record = result.record
        where = {"source": record.source, "index": record.index, **({"line": record.line} if record.line else {})}
        if result.reject:
            lines.append({"reject": {**where, "reason": result.reject,
                                     "detail": "the first turn's prompt is longer than --max-prompt-length"}})
        else:
            body = {"text": result.text} if record.text else {"messages": result.messages}
            lines.append({"id": record.sample_id, **body, "source": where,
                          "regenerated": {"tokens": result.generated_tokens, "unfinished_turns": result.unfinished_turns,
                                          "dropped_turns": result.dropped_turns}})
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


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


def lock_path(out: str) -> Path:
    return Path(out + ".lock")


def run_regenerate(config: RegenerateConfig, *, progress: Progress | None = None) -> RegenerateSummary:
    """The whole job; rerun the same command to resume after a crash."""
    started = time.perf_counter()
    _check(config)
    read = read_prompts(list(config.data), limit=config.limit, max_record_bytes=config.max_record_bytes)
    _check_chat_template(config, read)
    path = lock_path(config.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Held for the whole job, so two jobs never interleave chunks of one output.
    with exclusive_lock(str(path), lambda: ValueError(
            f"--out {config.out} is being written by another process (it holds {path}); wait for that job to "
            "finish, or choose another --out")):
        return _run_locked(config, read, progress, started)


def _run_locked(config: RegenerateConfig, read: PromptRead, progress: Progress | None,
                started: float) -> RegenerateSummary:
    facts = identity(config, read)
    facts_hash = _identity_hash(facts)
    out, manifest = Path(config.out), manifest_path(config.out)
    summary = RegenerateSummary(out=config.out)
    if out.exists():
        made = json.loads(manifest.read_text()) if manifest.is_file() else {}
        if made.get("identity_sha256") == facts_hash and not config.overwrite:
            for key, value in made["counts"].items():
                setattr(summary, key, value)
            summary.state = "complete"
            summary.seconds = time.perf_counter() - started
            return summary
        if not config.overwrite:
            raise ValueError(f"--out {config.out} exists and was not made by this command with these inputs and "
                             "settings; pass --overwrite to replace it")
        manifest.unlink(missing_ok=True)  # --overwrite: the old output must never pass for the new one
        out.unlink()
    if not read.records:
        raise ValueError(f"all {len(read.rejects)} records were rejected ({_reasons(Counter(r['reason'] for r in read.rejects))}); "
                         "nothing to regenerate; check the input format")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = _prepare_work_dir(config, facts_hash)
    size = config.chunk_size
    chunks = {k // size: read.records[k:k + size] for k in range(0, len(read.records), size)}
    pending = {k: records for k, records in chunks.items() if not _chunk_path(work, k).is_file()}
    summary.chunks, summary.chunks_resumed = len(chunks), len(chunks) - len(pending)
    summary.state = "resumed" if summary.chunks_resumed else "new"
    if progress is not None:
        progress.start(len(read.records))
        progress.advance(sum(len(r) for k, r in chunks.items() if k not in pending), 0)
    if pending:
        generate_started = time.perf_counter()
        summary.tokens_this_run = _answer_chunks(config, pending, work, progress)
        summary.generate_seconds = time.perf_counter() - generate_started
    _assemble(config, read, facts, facts_hash, len(chunks), work, summary)
    shutil.rmtree(work)
    summary.seconds = time.perf_counter() - started
    return summary


def _answer_chunks(config: RegenerateConfig, pending: dict[int, list[PromptRecord]], work: Path,
                   progress: Progress | None) -> int:
    """Run the actor pool over the pending chunks, writing each chunk file as it arrives; returns tokens."""
    import ray
    import ray.data

    from pipeline.regenerate.generation import ChunkAnswerer

    owned = connect_ray(config.address, config.num_workers)
    configure_ray_data()
    tokens = 0
    try:
        pool = size_actor_pool(items=len(pending), num_workers=config.num_workers,
                               num_gpus_per_worker=config.num_gpus_per_worker, threads=config.generate.threads,
                               address=config.address)
        generate = GenerateConfig(**{**asdict(config.generate), "model_path": os.path.abspath(config.generate.model_path),
                                     "threads": pool.threads})
        rows = [{"chunk": k, "records": pickle.dumps(records)} for k, records in sorted(pending.items())]
        dataset = pool.map_batches(ray.data.from_items(rows, override_num_blocks=len(rows)), ChunkAnswerer,
                                   config=generate)
        logger.info("regenerate: %d chunks on %d %s actor(s)", len(rows), pool.workers, pool.kind)
        for row in dataset.iter_rows():
            answered: list[Answered] = pickle.loads(row["answered"])
            atomic.write_text(_chunk_path(work, int(row["chunk"])), _chunk_lines(answered))
            chunk_tokens = sum(a.generated_tokens for a in answered)
            tokens += chunk_tokens
            if progress is not None:
                progress.advance(len(answered), chunk_tokens)
    finally:
        if owned:
            ray.shutdown()
    return tokens


def _assemble(config: RegenerateConfig, read: PromptRead, facts: dict[str, Any], facts_hash: str, chunks: int,
              work: Path, summary: RegenerateSummary) -> None:
    """Join the chunk files in order into the output, its rejects file and its manifest (manifest first)."""
    conversations: list[str] = []
    rejects = list(read.rejects)
    for k in range(chunks):
        for text in _chunk_path(work, k).read_text(encoding="utf-8").splitlines():
            line = json.loads(text)
            if "reject" in line:
                rejects.append(line["reject"])
                continue
            conversations.append(text)
            stats = line["regenerated"]
            summary.conversations += 1
            summary.turns += sum(m["role"] == "assistant" for m in line["messages"]) if "messages" in line else 1
            summary.generated_tokens += stats["tokens"]
            summary.unfinished_turns += stats["unfinished_turns"]
            summary.dropped_turns += stats["dropped_turns"]
    order = {path: i for i, path in enumerate(config.data)}
    rejects.sort(key=lambda r: (order.get(r["source"], 0), r["index"]))
    summary.rejected_by_reason = dict(sorted(Counter(r["reason"] for r in rejects).items()))
    if rejects:
        atomic.write_text(rejects_path(config.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))
    elif rejects_path(config.out).exists():
        rejects_path(config.out).unlink()
    counts = {key: getattr(summary, key) for key in ("conversations", "turns", "generated_tokens", "unfinished_turns",
                                                     "dropped_turns", "rejected_by_reason")}
    atomic.write_text(manifest_path(config.out), json.dumps(
        {"identity_sha256": facts_hash, **facts, "counts": counts,
         "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")
    atomic.write_text(Path(config.out), "".join(line + "\n" for line in conversations))
