"""The extraction job: read -> tokenize (Ray tasks) -> forward + write whole shards (Ray actor pool).

Determinism and resume: records are read in input order, tokenized, and the surviving samples are cut
into shards of `samples_per_shard` consecutive samples. That assignment depends only on the inputs and
settings (all inside the dataset_id), never on Ray scheduling, and each shard's forward batches depend
only on its samples' lengths. So a rerun after a crash skips committed shards, redoes the rest, and the
finished store is byte-identical per sample to an uninterrupted run.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from beagle.devices import torch_dtype
from beagle.target_facts import read_target_facts
from beagle.target_model import check_weights_match, weight_files
from pipeline.extract.chat import has_generation_markers, load_tokenizer, tokenizer_fingerprint
from pipeline.extract.forward import ForwardConfig, normalize_layers, target_fingerprint
from pipeline.extract.inputs import DEFAULT_MAX_RECORD_BYTES, ReadResult, check_data_path, read_inputs
from pipeline.extract.summary import ExtractSummary
from pipeline.ray_session import connect_ray, configure_ray_data, size_actor_pool

logger = logging.getLogger(__name__)

# Bump when tokenization, loss masks or the forward change what is stored for the same inputs.
EXTRACT_VERSION = 1


@dataclass(frozen=True)
class ExtractConfig:
    model_path: str
    data: tuple[str, ...]
    out: str
    layers: tuple[int, ...] = (-1,)
    max_length: int = 2048
    dtype: str = "bfloat16"
    batch_tokens: int = 16384
    num_workers: int | None = None  # None: one per GPU (per num_gpus_per_worker GPUs), or one CPU actor
    num_gpus_per_worker: float = 1.0  # GPUs each forward actor reserves (> 1 with device_map="auto")
    device_map: str | None = None  # "auto": spread the target's layers over the actor's GPUs
    threads: int | None = None  # torch threads per CPU actor; None: cores // workers on a local Ray
    address: str | None = None  # None: start a local Ray
    limit: int | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # larger input records are rejected as too_large
    overwrite: bool = False
    trust_remote_code: bool = False
    samples_per_shard: int = 256
    tokenize_chunk: int = 512  # records per tokenize task


class Progress(Protocol):
    """What the pipeline reports while it runs; the CLI draws it, library callers may pass None."""

    def start(self, samples: int, tokens: int) -> None: ...

    def advance(self, samples: int, tokens: int) -> None: ...


@dataclass
class Prepared:
    config: ExtractConfig
    tokenizer: Any
    layers: list[int]
    hidden_size: int
    vocab_size: int
    read: ReadResult
    samples: list[dict] = field(default_factory=list)  # tokenized, input order
    rejects: list[dict] = field(default_factory=list)
    actor_pids: set[int] = field(default_factory=set)  # forward actors that committed shards in this run
    actor_nodes: dict[int, str] = field(default_factory=dict)  # shard index -> Ray node id that wrote it
    actor_seconds: float = 0.0  # summed over shards: forward + write inside the actors
    actor_forward_seconds: float = 0.0  # summed over shards: the forward alone
    actor_spans: list[tuple[int, float, float, float]] = field(default_factory=list)  # pid, forward start/end, commit


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def prepare(config: ExtractConfig) -> Prepared:
    """Validate everything that can fail at once (files, model, tokenizer, settings), then read inputs."""
    if not config.data:
        raise ValueError("--data: give at least one input file")
    for path in config.data:
        check_data_path(path)
    weight_files(config.model_path)
    torch_dtype(config.dtype)
    if config.num_gpus_per_worker <= 0:
        raise ValueError(f"--num-gpus-per-worker {config.num_gpus_per_worker}: must be > 0")
    if config.device_map not in (None, "auto"):
        raise ValueError(f"--device-map {config.device_map}: only 'auto' is supported")
    for name in ("max_length", "batch_tokens", "samples_per_shard"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(config, name)}: must be at least 1")
    facts = read_target_facts(config.model_path, trust_remote_code=config.trust_remote_code)
    check_weights_match(config.model_path, facts.hidden_size, facts.vocab_size, facts.num_hidden_layers)
    layers = normalize_layers(config.layers, facts.num_hidden_layers)
    tokenizer = load_tokenizer(config.model_path, trust_remote_code=config.trust_remote_code)
    read = read_inputs(list(config.data), limit=config.limit, max_record_bytes=config.max_record_bytes)
    if any(r.messages is not None for r in read.records) and not isinstance(tokenizer.chat_template, str):
        raise ValueError(f"--model {config.model_path}: the tokenizer has no chat template, but the inputs hold "
                         "conversations; add a chat_template to tokenizer_config.json")
    return Prepared(config, tokenizer, layers, facts.hidden_size, facts.vocab_size, read)


def tokenize_all(prepared: Prepared, *, use_ray: bool) -> None:
    """Tokenize every record (Ray tasks, or in-process for --dry-run); fills samples and rejects."""
    from pipeline.extract.actor import tokenize_records

    config, records = prepared.config, prepared.read.records
    chunks = [records[i:i + config.tokenize_chunk] for i in range(0, len(records), config.tokenize_chunk)]
    if use_ray and len(chunks) > 1:  # one chunk: a Ray task would only add a worker start
        import ray.data

        from pipeline.extract.actor import tokenize_chunks

        dataset = ray.data.from_items([{"chunk": k, "records": pickle.dumps(c)} for k, c in enumerate(chunks)],
                                      override_num_blocks=len(chunks))
        dataset = dataset.map_batches(tokenize_chunks, batch_size=1, num_cpus=1, fn_kwargs={
            "model_path": _absolute(config.model_path), "trust_remote_code": config.trust_remote_code,
            "max_length": config.max_length})
        by_chunk = {int(row["chunk"]): pickle.loads(row["tokenized"]) for row in dataset.iter_rows()}
        results = [item for k in range(len(chunks)) for item in by_chunk[k]]
    else:
        results = tokenize_records(prepared.tokenizer, records, max_length=config.max_length)
    prepared.samples = [value for kind, value in results if kind == "sample"]
    prepared.rejects = [value for kind, value in results if kind == "reject"]


def identity(prepared: Prepared, target: dict) -> dict[str, dict]:
    """The facts the dataset_id is computed from (see pipeline.store.store_identity)."""
    config = prepared.config
    capture = {"layers": prepared.layers, "dtype": config.dtype, "max_length": config.max_length,
               "samples_per_shard": config.samples_per_shard, "limit": config.limit,
               "loss_mask": "assistant_turns", "extract_version": EXTRACT_VERSION}
    if config.max_record_bytes != DEFAULT_MAX_RECORD_BYTES:  # recorded only when set: older ids stay valid
        capture["max_record_bytes"] = config.max_record_bytes
    return {"target": target, "tokenizer": tokenizer_fingerprint(config.model_path, prepared.tokenizer),
            "capture": capture, "source": {"files": prepared.read.sources}}


def estimate_store_bytes(prepared: Prepared, tokens: int) -> tuple[int, int]:
    """(total, head): tokens x (layers x d x dtype size + 5 for ids and mask), plus the [V, d] head twice."""
    element = torch_dtype(prepared.config.dtype).itemsize
    head = 2 * prepared.vocab_size * prepared.hidden_size * element
    return tokens * (len(prepared.layers) * prepared.hidden_size * element + 5) + head, head


def _sorted_rejects(prepared: Prepared) -> list[dict]:
    order = {path: i for i, path in enumerate(prepared.config.data)}
    return sorted(prepared.read.rejects + prepared.rejects, key=lambda r: (order.get(r["source"], 0), r["index"]))


def _base_summary(prepared: Prepared, dataset_id: str) -> ExtractSummary:
    rejects = _sorted_rejects(prepared)
    return ExtractSummary(
        dataset_id=dataset_id, samples=len(prepared.samples),
        tokens=sum(len(s["input_ids"]) for s in prepared.samples),
        loss_tokens=sum(int(s["loss_mask"].sum()) for s in prepared.samples),
        rejected_by_reason=dict(sorted(Counter(r["reason"] for r in rejects).items())),
        truncated=sum(s["truncated"] for s in prepared.samples),
        dropped_leading_assistant=sum(s["dropped_leading_assistant"] > 0 for s in prepared.samples))


def dry_run(config: ExtractConfig) -> ExtractSummary:
    """Tokenize only: counts and the estimated store size, without Ray or the model."""
    prepared = prepare(config)
    tokenize_all(prepared, use_ray=False)
    summary = _base_summary(prepared, "")
    summary.dry_run = True
    summary.store_bytes, summary.head_bytes = estimate_store_bytes(prepared, summary.tokens)
    return summary


def _forward_shards(prepared: Prepared, shards: dict[int, list[dict]], url: str,
                    progress: Progress | None) -> list[dict]:
    """Run the actor pool over the pending shards; returns their infos as they commit."""
    import ray.data

    from pipeline.extract.actor import ShardExtractor

    config = prepared.config
    pool = size_actor_pool(items=len(shards), num_workers=config.num_workers,
                           num_gpus_per_worker=config.num_gpus_per_worker, threads=config.threads,
                           address=config.address)
    forward_config = ForwardConfig(model_path=_absolute(config.model_path), layers=tuple(prepared.layers),
                                   dtype=config.dtype, batch_tokens=config.batch_tokens, threads=pool.threads,
                                   trust_remote_code=config.trust_remote_code, device_map=config.device_map)
    rows = [{"shard_index": k, "samples": pickle.dumps([{key: s[key] for key in ("sample_id", "input_ids", "loss_mask")}
                                                         for s in samples])}
            for k, samples in sorted(shards.items())]
    dataset = pool.map_batches(ray.data.from_items(rows, override_num_blocks=len(rows)), ShardExtractor,
                               overlap=True, config=forward_config, store_url=url)
    logger.info("forward: %d shards on %d %s actor(s)", len(rows), pool.workers, pool.kind)
    infos = []
    for row in dataset.iter_rows():
        _record_shard(prepared, row, infos, progress)
    return infos


def _record_shard(prepared: Prepared, row: dict, infos: list[dict], progress: Progress | None) -> None:
    """Account for one shard a forward actor committed; raise the OSError an actor met writing one."""
    info = json.loads(row["info"])
    if "os_error" in info:
        failed = info["os_error"]
        raise OSError(failed["errno"], failed["strerror"], failed["filename"])
    infos.append(info)
    prepared.actor_pids.add(int(row["pid"]))
    prepared.actor_nodes[int(row["shard_index"])] = str(row.get("node", ""))
    logger.info("shard %d committed by pid %d on node %s", int(row["shard_index"]), int(row["pid"]),
                prepared.actor_nodes[int(row["shard_index"])])
    prepared.actor_seconds += float(row["seconds"])
    prepared.actor_forward_seconds += float(row["forward_seconds"])
    prepared.actor_spans.append((int(row["pid"]), *(float(t) for t in row["spans"])))
    if progress is not None:
        progress.advance(info["samples"], info["tokens"])


def run_extract(config: ExtractConfig, *, progress: Progress | None = None) -> ExtractSummary:
    """The whole job; resumable by rerunning the same command.

    The driver holds the store's lock (STORE/_lock, flock) from the first check to the manifest, so a
    second extraction into the same local store is refused at once instead of interleaving with this one;
    the kernel releases the lock if the driver dies, so a rerun after a crash is never blocked.
    """
    from pipeline.store.writer import store_lock

    started = time.perf_counter()
    prepared = prepare(config)
    url = _absolute(config.out)
    with store_lock(url):
        return _run_locked(config, prepared, url, progress, started)


def _run_locked(config: ExtractConfig, prepared: Prepared, url: str, progress: Progress | None,
                started: float) -> ExtractSummary:
    """Inside the store lock: find the shards already committed, forward the rest, commit the manifest."""
    from pipeline.store import begin_store, compute_dataset_id, store_identity
    from pipeline.store.writer import abandon_new_store

    facts = identity(prepared, target_fingerprint(config.model_path, config.dtype,
                                                  trust_remote_code=config.trust_remote_code))
    dataset_id = compute_dataset_id(store_identity(**facts))
    state = begin_store(url, dataset_id, overwrite=config.overwrite)
    if state == "complete":
        return _complete_summary(url, dataset_id, started)
    owned = connect_ray(config.address, config.num_workers)
    configure_ray_data()
    try:
        tokenize_all(prepared, use_ray=True)
        summary = _base_summary(prepared, dataset_id)
        if not prepared.samples:
            if state == "new":
                abandon_new_store(url)  # nothing written: the corrected rerun must not meet a half-made store
            raise ValueError(f"all {summary.rejected} records were rejected ({summary.rejected_by_reason}); "
                             "nothing to extract; check the input format and --max-length")
        shards, done = _plan_shards(prepared, url)
        if progress is not None:
            progress.start(summary.samples, summary.tokens)
            progress.advance(sum(i["samples"] for i in done.values()), sum(i["tokens"] for i in done.values()))
        forward_started = time.perf_counter()
        pending = {k: samples for k, samples in shards.items() if k not in done}
        infos = _forward_shards(prepared, pending, url, progress) if pending else []
        summary.forward_seconds = time.perf_counter() - forward_started
        summary.forward_tokens = sum(i["tokens"] for i in infos)
        _commit_store(prepared, url, dataset_id, facts, summary, list(done.values()) + infos)
    finally:
        if owned:
            import ray
            ray.shutdown()
    summary.shards, summary.shards_resumed, summary.state = len(shards), len(done), state
    _add_run_facts(summary, prepared, url, started)
    return summary


def _complete_summary(url: str, dataset_id: str, started: float) -> ExtractSummary:
    """The summary of a store that a finished run of the same inputs already wrote (nothing to do)."""
    from pipeline.store import open_store

    store = open_store(url)
    counts = store.manifest["counts"]
    logger.info("%s is already a complete store of these inputs; nothing to do", url)
    return ExtractSummary(dataset_id=dataset_id, samples=counts["samples"], tokens=counts["tokens"],
                          loss_tokens=counts["loss_tokens"], rejected_by_reason=counts["rejected_by_reason"],
                          shards=len(store.manifest["shards"]), shards_resumed=len(store.manifest["shards"]),
                          store_bytes=_store_bytes(url), head_bytes=_head_bytes(url), state="complete",
                          seconds=time.perf_counter() - started)


def _plan_shards(prepared: Prepared, url: str) -> tuple[dict[int, list[dict]], dict[int, dict]]:
    """(every shard's samples, the infos of shards an earlier run already committed)."""
    from pipeline.store import committed_shards

    size = prepared.config.samples_per_shard
    samples = prepared.samples
    shards = {k // size: samples[k:k + size] for k in range(0, len(samples), size)}
    done = {k: info for k, info in committed_shards(url, remove_damaged=True).items() if k in shards}
    if done:
        logger.info("resuming %s: %d of %d shards already committed", url, len(done), len(shards))
    return shards, done


def _head_from_files(config: ExtractConfig, prepared: Prepared) -> dict:
    """The embedding and LM head for the store, read from the weight files (two tensors); only where they
    cannot be found by name there is the whole target loaded on the driver's CPU for them."""
    from beagle.target_model import read_head_weights

    head = read_head_weights(config.model_path, config.dtype, trust_remote_code=config.trust_remote_code)
    if head is not None:
        return head
    from pipeline.extract.forward import TargetForward
    logger.info("loading %s on the driver's CPU to write the store's head", config.model_path)
    return TargetForward(ForwardConfig(config.model_path, tuple(prepared.layers), config.dtype, device="cpu",
                                       trust_remote_code=config.trust_remote_code)).head()


def _commit_store(prepared: Prepared, url: str, dataset_id: str, facts: dict[str, dict],
                  summary: ExtractSummary, shards: list[dict]) -> None:
    """Write what the shards do not hold (the head, the rejects), then the manifest that makes it a store."""
    from pipeline.extract.store_tensors import write_head
    from pipeline.store import commit_manifest, write_rejects
    from pipeline.store import format as fmt

    config = prepared.config
    fs, root = fmt.open_fs(url)
    if not fs.exists(fmt.join(root, fmt.HEAD)):  # every shard was committed before a crash
        write_head(url, **_head_from_files(config, prepared))
    rejects = _sorted_rejects(prepared)
    if rejects:
        write_rejects(url, rejects)
    extra = {"extract": {"version": EXTRACT_VERSION, "truncated": summary.truncated,
                         "dropped_leading_assistant": summary.dropped_leading_assistant,
                         "loss_mask_method": "generation_markers" if has_generation_markers(prepared.tokenizer)
                         else "prefix_diff", "batch_tokens": config.batch_tokens}}
    commit_manifest(url, dataset_id=dataset_id, **facts, shards=shards, rejected=summary.rejected_by_reason,
                    extra=extra)


def _add_run_facts(summary: ExtractSummary, prepared: Prepared, url: str, started: float) -> None:
    """What the run measured: actors and nodes used, their time, the store's size, the wall time."""
    summary.actors = len(prepared.actor_pids)
    summary.nodes = len(set(prepared.actor_nodes.values()))
    summary.actor_seconds, summary.actor_forward_seconds = prepared.actor_seconds, prepared.actor_forward_seconds
    summary.write_overlap_seconds = write_overlap_seconds(prepared.actor_spans)
    summary.actor_busy_seconds = actor_busy_seconds(prepared.actor_spans)
    summary.store_bytes, summary.head_bytes = _store_bytes(url), _head_bytes(url)
    summary.seconds = time.perf_counter() - started


def write_overlap_seconds(spans: list[tuple[int, float, float, float]]) -> float:
    """How long shards were being written while the same actor already forwarded the next one: the write
    time the overlap hid from the device. `spans`: (actor pid, forward start, forward end, committed)."""
    hidden = 0.0
    for pid in {span[0] for span in spans}:
        mine = sorted(span[1:] for span in spans if span[0] == pid)
        for (_, written_from, written_to), (next_start, next_end, _) in zip(mine, mine[1:]):
            hidden += max(0.0, min(written_to, next_end) - max(written_from, next_start))
    return hidden


def actor_busy_seconds(spans: list[tuple[int, float, float, float]]) -> float:
    """Each actor's wall time from its first forward to its last commit, summed over actors: the time the
    actors spent on shards, without their start (process, model load) or the driver's own work."""
    busy = 0.0
    for pid in {span[0] for span in spans}:
        mine = [span for span in spans if span[0] == pid]
        busy += max(span[3] for span in mine) - min(span[1] for span in mine)
    return busy


def _store_bytes(url: str) -> int:
    from pipeline.store import format as fmt
    fs, root = fmt.open_fs(url)
    return int(sum(fs.du(root, total=False).values()))


def _head_bytes(url: str) -> int:
    from pipeline.store import format as fmt
    fs, root = fmt.open_fs(url)
    return int(fs.size(fmt.join(root, fmt.HEAD)))
