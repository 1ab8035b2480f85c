"""The extraction job, streamed: read -> tokenize (Ray tasks) -> shards -> forward + write (Ray actors).

Determinism and resume: records are read in input order, tokenized, and the surviving samples are cut
into shards of `samples_per_shard` consecutive samples. That assignment depends only on the inputs and
settings (all inside the dataset_id), never on Ray scheduling, and each shard's forward batches depend
only on its samples' lengths. So a rerun after a crash skips committed shards, redoes the rest, and the
finished store is byte-identical per sample to an uninterrupted run.

Memory: the driver never holds the inputs. One pass over them first (`scan_inputs`) counts what the
dataset_id needs and keeps no record; the second reads them as a stream, tokenized a few chunks at a
time (pipeline.extract.stream), and each shard goes to the forward actors as soon as it is formed
(pipeline.extract.dispatch), two at most per actor. While the actors are full the driver stops reading.
What it keeps grows only with the rejects, the ids seen (duplicate detection) and one info per shard.
The steps are the job kit's (pipeline.jobkit): the record stream, the chunk plan (shards are its chunks),
the actor dispatch; this module says what is extraction's own.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator

from beagle.devices import torch_dtype
from beagle.host_memory import peak_rss_mib
from beagle.errors import SettingsError
from beagle.layer_capture import normalize_layers
from beagle.registry import capture_layers
from beagle.records import DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_TURNS, check_data_path
from beagle.target_facts import read_target_facts
from beagle.target_model import TargetSpec, check_weights_match, weight_files
from pipeline.extract.chat import has_generation_markers, tokenizer_fingerprint
from pipeline.extract.dispatch import Forwarded, actor_busy_seconds, write_overlap_seconds
from pipeline.extract.forward import ForwardConfig
from pipeline.extract.inputs import scan_inputs, stream_inputs
from pipeline.extract.stream import ChunkSize, SampleCounts, form_shards, tokenized
from pipeline.extract.summary import ExtractSummary
from pipeline.jobkit.dispatch import ActorDispatcher, ActorSpec
from pipeline.jobkit.target import load_tokenizer, target_fingerprint
from pipeline.jobkit.plan import run_chunks
from pipeline.jobkit.progress import Progress
from pipeline.jobkit.ray_session import joined_cluster, ray_for_job, workers_use_gpus
from pipeline.jobkit.vllm_process import VllmConfig, check_vllm_options, engine_actor_pool, engine_facts, engine_identity
from pipeline.jobkit.record_stream import (InputChangedError, InputScan, RecordStream, check_unchanged,
                                           refuse_changed)
from pipeline.jobkit.rejects import count_reasons, sorted_rejects
from pipeline.store.errors import StoreFormatError
from pipeline.store.format import LOSSY_DTYPES, StoreEncoding

logger = logging.getLogger(__name__)

# Bump when tokenization, loss masks or the forward change what is stored for the same inputs.
EXTRACT_VERSION = 1


@dataclass(frozen=True)
class ExtractConfig:
    model_path: str
    data: tuple[str, ...]
    out: str
    layers: tuple[int, ...] | None = None  # None: what layers_for's forms need (EAGLE-3's aux layers + -1 for all)
    layers_for: tuple[str, ...] | None = None  # drafter forms the store must train (beagle/registry.py); None: all
    max_length: int = 2048
    dtype: str = "bfloat16"  # the target's dtype, and the stored one unless store_dtype says otherwise
    # None: dtype; "float8_e4m3" or "int8": one byte a value plus a scale a token; "bfloat16" from a float32
    # target: the states rounded once to bf16, for CPUs that emulate bf16 (fp32 forwards ~5x faster there)
    store_dtype: str | None = None
    compression: str = "none"  # "zstd": smaller files, read through zarr instead of a memory map
    batch_tokens: int | None = None  # None: per device kind, see default_batch_tokens
    num_workers: int | None = None  # None: one per GPU (per num_gpus_per_worker GPUs), or one CPU actor
    num_gpus_per_worker: float = 1.0  # GPUs each forward actor reserves (> 1 with device_map="auto")
    device_map: str | None = None  # "auto": spread the target's layers over the actor's GPUs
    threads: int | None = None  # torch threads per CPU actor; None: cores // workers on a local Ray
    address: str | None = None  # None: start a local Ray
    limit: int | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # larger input records are rejected as too_large
    max_turns: int = DEFAULT_MAX_TURNS  # conversations of more turns are rejected as too_many_turns
    overwrite: bool = False
    trust_remote_code: bool = False
    samples_per_shard: int = 256
    tokenize_chunk: int = 512  # records per tokenize task (fewer when they are long: tokenize_chunk_chars)
    tokenize_chunk_chars: int = 8 << 20  # about this many characters of text per tokenize task at most
    tokenize_tasks: int = 4  # tokenize tasks in flight at once: with the chunk size, the records held at once
    engine: str = "hf"  # "vllm": vLLM runs the target (pipeline/extract/vllm_forward.py)
    vllm: VllmConfig = VllmConfig()  # --engine vllm: its environment and how one engine spreads

    @property
    def target(self) -> TargetSpec:
        """How extraction opens the target: the one `TargetSpec` every command uses."""
        return TargetSpec(self.model_path, self.dtype, self.trust_remote_code, self.device_map)

    @property
    def encoding(self) -> StoreEncoding:
        """How the store keeps the states (pipeline/store/format.py): dtype and codec."""
        return StoreEncoding(self.store_dtype or self.dtype, self.compression)


@dataclass
class Prepared:
    config: ExtractConfig
    tokenizer: Any
    layers: list[int]
    hidden_size: int
    vocab_size: int
    scan: InputScan


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)


def prepare(config: ExtractConfig) -> Prepared:
    """Validate everything that can fail at once (files, model, tokenizer, settings), then scan the inputs
    (one pass that keeps no record: the counts the dataset_id needs, and whether a chat template is)."""
    if not config.data:
        raise ValueError("--data: give at least one input file")
    for path in config.data:
        check_data_path(path)
    weight_files(config.model_path)
    torch_dtype(config.dtype)
    try:
        config.encoding
    except StoreFormatError as error:
        raise ValueError(f"--store-dtype / --compression: {error}") from None
    _check_store_dtype(config.dtype, config.store_dtype)
    if config.num_gpus_per_worker <= 0:
        raise ValueError(f"--num-gpus-per-worker {config.num_gpus_per_worker}: must be > 0")
    if config.device_map not in (None, "auto"):
        raise ValueError(f"--device-map {config.device_map}: only 'auto' is supported")
    for name in ("max_length", "batch_tokens", "samples_per_shard", "max_turns"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(config, name)}: must be at least 1")
    facts = read_target_facts(config.model_path, trust_remote_code=config.trust_remote_code)
    check_weights_match(config.model_path, facts.hidden_size, facts.vocab_size, facts.num_hidden_layers)
    n = facts.num_hidden_layers
    _check_engine(config, facts.max_position_embeddings)
    if config.layers is not None and config.layers_for is not None:
        raise SettingsError("--layers and --layers-for both choose the captured layers; give one")
    layers = normalize_layers(config.layers if config.layers is not None else capture_layers(config.layers_for, n), n)
    tokenizer = load_tokenizer(config.model_path, trust_remote_code=config.trust_remote_code)
    scan = scan_inputs(list(config.data), limit=config.limit, max_record_bytes=config.max_record_bytes,
                       max_turns=config.max_turns)
    if scan.conversations and not isinstance(tokenizer.chat_template, str):
        raise ValueError(f"--model {config.model_path}: the tokenizer has no chat template, but the inputs hold "
                         "conversations; add a chat_template to tokenizer_config.json")
    _warn_if_bf16_is_emulated(config)
    return Prepared(config, tokenizer, layers, facts.hidden_size, facts.vocab_size, scan)


def _check_store_dtype(dtype: str, store_dtype: str | None) -> None:
    """A store keeps the target's own dtype, a lossy one-byte code, or bf16 rounded from a float32 target
    (bf16's exponent range is float32's, so nothing finite overflows; the manifest's `target.dtype` says the
    states were computed in float32). Anything else is a setting, refused in one line (exit 2) naming what
    would work."""
    if store_dtype is None or store_dtype in LOSSY_DTYPES or store_dtype == dtype:
        return
    if store_dtype == "bfloat16" and dtype == "float32":
        return
    raise SettingsError(f"--store-dtype {store_dtype}: with --dtype {dtype} a store keeps {dtype}, bfloat16 from "
                        f"--dtype float32, or a lossy code ({', '.join(sorted(LOSSY_DTYPES))}); "
                        f"give --dtype {store_dtype} or one of those")


def _warn_if_bf16_is_emulated(config: ExtractConfig) -> None:
    """Once, where the target would forward in bf16 on a CPU that emulates it (AVX2 only, no AMX or
    AVX512-BF16): fp32 runs it several times faster there. The default stays bf16, the dtype stores are
    shared in (half the bytes); a joined cluster is taken to be GPU workers."""
    if config.dtype != "bfloat16":
        return
    from beagle.precision import bf16_is_emulated

    if bf16_is_emulated(on_gpu=workers_use_gpus(config.address, config.num_gpus_per_worker)):
        logger.warning("--dtype bfloat16 on this CPU (no AMX or AVX512-BF16) is emulated: the target forwards "
                       "~5x slower than in float32 (docs/extract.md); pass --dtype float32 --store-dtype "
                       "bfloat16 for speed at the same store size")


def _check_engine(config: ExtractConfig, max_positions: int | None) -> None:
    """--engine and vLLM's options, before anything starts (pipeline/jobkit/vllm_process.py)."""
    check_vllm_options(config.engine, config.vllm, num_gpus_per_worker=config.num_gpus_per_worker)
    if config.engine != "vllm":
        return
    if config.device_map:
        raise ValueError("--device-map is the transformers engine's; with --engine vllm give "
                         "--tensor-parallel-size / --pipeline-parallel-size")
    if max_positions and config.max_length >= max_positions:
        # vLLM takes no prompt of the model's positions or more (one token is sampled after it)
        raise ValueError(f"--max-length {config.max_length}: the target has {max_positions} positions, and vLLM "
                         f"takes no prompt that long; give at most {max_positions - 1}")


def _records(prepared: Prepared) -> RecordStream:
    config = prepared.config
    return stream_inputs(list(config.data), prepared.scan, limit=config.limit,
                         max_record_bytes=config.max_record_bytes, max_turns=config.max_turns)


def _samples(prepared: Prepared, records: RecordStream, *, use_ray: bool) -> Iterator[tuple[str, dict]]:
    """The records' tokenize results in input order: Ray tasks, or here for --dry-run."""
    config = prepared.config
    return tokenized(records, tokenizer=prepared.tokenizer, model_path=_absolute(config.model_path),
                     trust_remote_code=config.trust_remote_code, max_length=config.max_length,
                     chunk_size=ChunkSize(config.tokenize_chunk, config.tokenize_chunk_chars),
                     in_flight=config.tokenize_tasks if use_ray else None)


def identity(prepared: Prepared, target: dict, engine: dict[str, Any] | None = None) -> dict[str, dict]:
    """The facts the dataset_id is computed from (see pipeline.store.store_identity). vLLM's name and version
    count (its kernels round differently: a store from one engine is never resumed with the other), the
    transformers engine does not, so stores made before the engine was chosen keep their id."""
    config = prepared.config
    capture = {"layers": prepared.layers, "dtype": config.encoding.dtype, "max_length": config.max_length,
               "samples_per_shard": config.samples_per_shard, "limit": config.limit,
               "loss_mask": "assistant_turns", "extract_version": EXTRACT_VERSION}
    if config.max_record_bytes != DEFAULT_MAX_RECORD_BYTES:  # recorded only when set: older ids stay valid
        capture["max_record_bytes"] = config.max_record_bytes
    if config.max_turns != DEFAULT_MAX_TURNS:
        capture["max_turns"] = config.max_turns
    if config.encoding.compression != "none":
        capture["compression"] = config.encoding.compression
    if engine is not None and engine_identity(engine) is not None:
        capture["engine"] = engine_identity(engine)
    return {"target": target, "tokenizer": tokenizer_fingerprint(config.model_path, prepared.tokenizer),
            "capture": capture, "source": {"files": prepared.scan.sources}}


def estimate_store_bytes(prepared: Prepared, tokens: int) -> tuple[int, int]:
    """(total, head): tokens x (layers x d x dtype size + 5 for ids and mask), plus the [V, d] head twice."""
    head = 2 * prepared.vocab_size * prepared.hidden_size * torch_dtype(prepared.config.dtype).itemsize
    encoding = prepared.config.encoding
    # A lossy store keeps one byte a value and a float32 scale a token; zstd is not estimated (it depends on
    # the states: about 0.75 of bf16, 0.6-0.7 of int8 codes on the demo target).
    per_layer = (prepared.hidden_size + 4 if encoding.dtype in LOSSY_DTYPES
                 else prepared.hidden_size * torch_dtype(encoding.dtype).itemsize)
    return tokens * (len(prepared.layers) * per_layer + 5) + head, head


def _base_summary(counts: SampleCounts, rejects: list[dict], dataset_id: str) -> ExtractSummary:
    return ExtractSummary(
        dataset_id=dataset_id, samples=counts.samples, tokens=counts.tokens, loss_tokens=counts.loss_tokens,
        rejected_by_reason=count_reasons(rejects),
        truncated=counts.truncated, dropped_leading_assistant=counts.dropped_leading_assistant)


def dry_run(config: ExtractConfig) -> ExtractSummary:
    """Tokenize only: counts and the estimated store size, without Ray or the model."""
    prepared = prepare(config)
    records, counts = _records(prepared), SampleCounts()
    for _ in form_shards(_samples(prepared, records, use_ray=False), config.samples_per_shard, counts):
        pass
    summary = _base_summary(counts, sorted_rejects(config.data, records.rejects, counts.rejects), "")
    summary.dry_run = True
    summary.store_bytes, summary.head_bytes = estimate_store_bytes(prepared, summary.tokens)
    summary.driver_peak_rss_mib = peak_rss_mib()
    return summary


@dataclass
class Streamed:
    """What streaming the inputs through tokenizing and the forward actors produced."""

    counts: SampleCounts
    rejects: list[dict]  # of reading and of tokenizing, in input order
    shards: int  # shards formed
    kept: list[dict]  # infos of the shards an earlier run had committed (not forwarded again)
    forwarded: Forwarded  # what the actors did in this run
    batch_tokens: int | None  # the forward's batch size in this run (None: nothing forwarded, none given)


def _stream_shards(prepared: Prepared, url: str, progress: Progress | None) -> Streamed:
    """Form every shard from the stream of inputs; keep those an earlier run committed, hand the others to
    the forward actors as they form (the actors start with the first one)."""
    from pipeline.store import committed_shards

    config = prepared.config
    committed = committed_shards(url, remove_damaged=True)
    if committed:
        logger.info("resuming %s: %d shard(s) already committed", url, len(committed))
    records, counts = _records(prepared), SampleCounts()
    forwarded = Forwarded()
    forward_config: list[ForwardConfig] = []  # set when the actors start
    reported = 0

    def report_rejects() -> None:  # tokenizing rejects count towards the progress total too
        nonlocal reported
        if progress is not None and len(counts.rejects) > reported:
            progress.advance(len(counts.rejects) - reported, 0, this_run=False)
        reported = len(counts.rejects)

    def shards() -> Iterator[tuple[int, list[dict]]]:
        for index, samples in form_shards(_samples(prepared, records, use_ray=True), config.samples_per_shard,
                                          counts):
            report_rejects()
            yield index, samples

    def kept(index: int, samples: list[dict], info: dict) -> None:
        if progress is not None:
            progress.advance(len(samples), info["tokens"], this_run=False)

    def start_actors() -> ActorDispatcher:
        pending = max(1, math.ceil(prepared.scan.records / config.samples_per_shard) - len(committed))
        dispatcher = _dispatcher(prepared, url, pending, forwarded, progress)
        forward_config.append(dispatcher.spec.args[0])
        return dispatcher

    if progress is not None:
        progress.start(prepared.scan.records)
    try:
        # a stat per input before each shard: stop before forwarding bytes that were not hashed
        run = run_chunks(shards(), committed=committed, start_actors=start_actors, on_kept=kept,
                         before_dispatch=lambda: refuse_changed(prepared.scan, job="extract", output="the store"))
        report_rejects()
        check_unchanged(prepared.scan, records, job="extract", output="the store")
    except InputChangedError:  # the shards this run committed were made from bytes that were not hashed
        _discard_shards(url, [info["index"] for info in forwarded.infos])
        raise
    forwarded.seconds = run.seconds
    batch_tokens = forward_config[0].batch_tokens if forward_config else config.batch_tokens
    # Samples the actors left out (non-finite states) are in their shards' shard.json, kept shards' too.
    forward_rejects = [reject for info in run.kept + forwarded.infos for reject in info.get("rejects", ())]
    return Streamed(counts, sorted_rejects(config.data, records.rejects, counts.rejects, forward_rejects),
                    run.chunks, run.kept, forwarded, batch_tokens)


def _discard_shards(url: str, indices: list[int]) -> None:
    """Delete shards this run committed (the caller holds the store's lock)."""
    from pipeline.store import format as fmt

    fs, root = fmt.open_fs(url)
    for index in indices:
        path = fmt.join(root, fmt.SHARDS_DIR, fmt.shard_name(index))
        if fs.exists(path):
            fs.rm(path, recursive=True)


# Padded tokens per forward batch when --batch-tokens is not given. A GPU wants large batches. A CPU does not:
# the demo target forwarded 3,700 tokens/s in batches of 2,048-4,096 tokens, 2,740 at 8,192 and 1,810 at
# 16,384, against 3,240 one sample at a time (2 cores with AMX, bf16, ShareGPT <= 1,024 tokens; a large
# batch's activations no longer fit the caches).
DEFAULT_BATCH_TOKENS = {"GPU": 16384, "CPU": 4096}


def default_batch_tokens(config: ExtractConfig, device_kind: str) -> int:
    """--batch-tokens, or the default for the forward actors' device kind ("GPU" or "CPU")."""
    return config.batch_tokens or DEFAULT_BATCH_TOKENS[device_kind]


def _dispatcher(prepared: Prepared, url: str, pending: int, forwarded: Forwarded,
                progress: Progress | None) -> ActorDispatcher:
    """The forward actors for at most `pending` shards: one per GPU (per --num-gpus-per-worker), or
    --num-workers, or one CPU actor; they start with the first shard handed to them. Two shards in flight
    on each, run on two threads of the actor: one is written while the next is forwarded (`ShardExtractor`).
    Every shard they commit is recorded in `forwarded`."""
    from pipeline.extract.actor import ShardExtractor

    config = prepared.config
    pool, vllm = engine_actor_pool(config.engine, config.vllm, items=pending, num_workers=config.num_workers,
                                   num_gpus_per_worker=config.num_gpus_per_worker, threads=config.threads,
                                   address=config.address)
    forward_config = ForwardConfig(model_path=_absolute(config.model_path), layers=tuple(prepared.layers),
                                   dtype=config.dtype, batch_tokens=default_batch_tokens(config, pool.kind),
                                   threads=pool.threads,
                                   trust_remote_code=config.trust_remote_code, device_map=config.device_map,
                                   engine=config.engine, vllm=vllm, max_length=config.max_length)

    def on_result(result: dict[str, Any]) -> None:
        info = forwarded.record(result)
        if progress is not None:
            progress.advance(info["samples"] + len(info.get("rejects", ())), info["tokens"], this_run=True)

    spec = ActorSpec(ShardExtractor, (forward_config, url, config.encoding), method="extract", per_actor=2,
                     concurrency=2, label=f"forward ({config.engine})", close_method="close")
    return ActorDispatcher(pool, spec, on_result)


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
    from pipeline.store import begin_store, committed_shards, compute_dataset_id, store_identity
    from pipeline.store.writer import abandon_new_store

    engine = engine_facts(config.engine, config.vllm, config.model_path, trust_remote_code=config.trust_remote_code,
                          joined_cluster=joined_cluster(config.address))
    facts = identity(prepared, target_fingerprint(config.model_path, config.dtype,
                                                  trust_remote_code=config.trust_remote_code), engine)
    dataset_id = compute_dataset_id(store_identity(**facts))
    state = begin_store(url, dataset_id, overwrite=config.overwrite)
    if state == "complete":
        return _complete_summary(url, dataset_id, started)
    with ray_for_job(config.address, config.num_workers):
        try:
            streamed = _stream_shards(prepared, url, progress)
        except InputChangedError:  # its shards were discarded
            if state == "new" and not committed_shards(url):
                abandon_new_store(url)  # so that the rerun, with the final inputs, meets no half-made store
            raise
        summary = _base_summary(streamed.counts, streamed.rejects, dataset_id)
        shards = streamed.kept + streamed.forwarded.infos
        # What the shards hold: the tokenized samples less those the actors rejected (non-finite states).
        summary.samples, summary.tokens, summary.loss_tokens = (sum(info[key] for info in shards)
                                                                for key in ("samples", "tokens", "loss_tokens"))
        if not summary.samples:
            _discard_shards(url, [info["index"] for info in shards])  # empty ones, when the actors rejected all
            if state == "new":
                abandon_new_store(url)  # nothing written: the corrected rerun must not meet a half-made store
            if not summary.rejected:
                raise ValueError(f"--data {', '.join(map(str, config.data))}: no records in the input; nothing to "
                                 "extract")
            raise ValueError(f"all {summary.rejected} records were rejected ({summary.rejected_by_reason}); "
                             "nothing to extract; check the input format and --max-length")
        summary.forward_seconds = streamed.forwarded.seconds
        summary.forward_tokens = sum(i["tokens"] for i in streamed.forwarded.infos)
        _commit_store(prepared, url, dataset_id, facts, summary, streamed.rejects, shards, streamed.batch_tokens,
                      engine)
    summary.shards, summary.shards_resumed, summary.state = streamed.shards, len(streamed.kept), state
    _add_run_facts(summary, streamed.forwarded, url, started)
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
                          seconds=time.perf_counter() - started, driver_peak_rss_mib=peak_rss_mib())


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
                  summary: ExtractSummary, rejects: list[dict], shards: list[dict], batch_tokens: int | None,
                  engine: dict[str, Any]) -> None:
    """Write what the shards do not hold (the head, the rejects), then the manifest that makes it a store."""
    from pipeline.extract.state_encoding import write_head
    from pipeline.store import commit_manifest, write_rejects
    from pipeline.store import format as fmt

    config = prepared.config
    fs, root = fmt.open_fs(url)
    if not fs.exists(fmt.join(root, fmt.HEAD)):  # every shard was committed before a crash
        write_head(url, **_head_from_files(config, prepared))
    if rejects:
        write_rejects(url, rejects)
    extra = {"extract": {"version": EXTRACT_VERSION, "truncated": summary.truncated,
                         "dropped_leading_assistant": summary.dropped_leading_assistant,
                         "loss_mask_method": "generation_markers" if has_generation_markers(prepared.tokenizer)
                         else "prefix_diff", "batch_tokens": batch_tokens, "engine": engine}}
    # A shard's rejects stay in its shard.json (for a resume) and go to rejects.jsonl, not into the manifest.
    shards = [{key: value for key, value in info.items() if key != "rejects"} for info in shards]
    commit_manifest(url, dataset_id=dataset_id, **facts, shards=shards, rejected=summary.rejected_by_reason,
                    extra=extra)


def _add_run_facts(summary: ExtractSummary, forwarded: Forwarded, url: str, started: float) -> None:
    """What the run measured: actors and nodes used, their time, the store's size, the wall time, and the
    driver's peak memory (bounded whatever the size of the inputs)."""
    summary.actors = len(forwarded.actor_pids)
    summary.nodes = len(set(forwarded.actor_nodes.values()))
    summary.actor_seconds, summary.actor_forward_seconds = forwarded.actor_seconds, forwarded.actor_forward_seconds
    summary.write_overlap_seconds = write_overlap_seconds(forwarded.actor_spans)
    summary.actor_busy_seconds = actor_busy_seconds(forwarded.actor_spans)
    summary.store_bytes, summary.head_bytes = _store_bytes(url), _head_bytes(url)
    summary.seconds = time.perf_counter() - started
    summary.driver_peak_rss_mib = peak_rss_mib()


def _store_bytes(url: str) -> int:
    from pipeline.store import format as fmt
    fs, root = fmt.open_fs(url)
    return int(sum(fs.du(root, total=False).values()))


def _head_bytes(url: str) -> int:
    from pipeline.store import format as fmt
    fs, root = fmt.open_fs(url)
    return int(fs.size(fmt.join(root, fmt.HEAD)))
