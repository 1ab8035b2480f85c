"""Records -> tokenized samples -> shards, as a stream whose memory does not grow with the inputs.

Records are cut into chunks of consecutive records (at most `max_records` of them and about `max_chars`
characters of text: a chunk of 512 long conversations must not hold hundreds of MB), each chunk is
tokenized by a Ray task, and the results are consumed in chunk order, whatever order the tasks finish in.
The surviving samples are then cut into shards of `samples_per_shard` consecutive samples. Shard
boundaries therefore depend only on the inputs and settings (all inside the dataset_id), never on chunk
sizes or Ray scheduling: what makes a rerun after a crash byte-identical to an uninterrupted run.

Memory: at most `in_flight` chunks are being tokenized, and the generators here run only as fast as their
consumer pulls (the driver stops pulling while the forward actors have all the shards they may hold), so
the records held at once are bounded by the chunk sizes, not by the inputs.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from pipeline.extract.actor import tokenize_chunk, tokenize_records
from pipeline.extract.inputs import Record

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkSize:
    """How records are grouped for tokenizing: by count and by text size, whichever is reached first."""

    max_records: int = 512
    max_chars: int = 8 << 20  # a single larger record is a chunk of its own


@dataclass
class SampleCounts:
    """What the summary reports about the samples, added up as they stream past (never a list of them)."""

    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    dropped_leading_assistant: int = 0
    rejects: list[dict[str, Any]] = field(default_factory=list)  # tokenizing rejects, in input order

    def add(self, sample: dict[str, Any]) -> None:
        self.samples += 1
        self.tokens += len(sample["input_ids"])
        self.loss_tokens += int(sample["loss_mask"].sum())
        self.truncated += int(sample["truncated"])
        self.dropped_leading_assistant += int(sample["dropped_leading_assistant"] > 0)


def record_chars(record: Record) -> int:
    """Characters of text a record brings to tokenizing (its conversation's contents, or its text)."""
    if record.messages is not None:
        return sum(len(content) for _, content in record.messages)
    return len(record.text or "")


def record_chunks(records: Iterable[Record], size: ChunkSize) -> Iterator[list[Record]]:
    """Consecutive records, `size.max_records` at most per chunk and about `size.max_chars` of text."""
    chunk: list[Record] = []
    chars = 0
    for record in records:
        chunk.append(record)
        chars += record_chars(record)
        if len(chunk) >= size.max_records or chars >= size.max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def tokenized(records: Iterable[Record], *, tokenizer: Any, model_path: str, trust_remote_code: bool,
              max_length: int, chunk_size: ChunkSize, in_flight: int | None) -> Iterator[tuple[str, dict]]:
    """("sample", ...) and ("reject", ...) results of `tokenize_records`, in input order.

    in_flight: chunks tokenized at once by Ray tasks; None tokenizes here, one chunk after the other
    (--dry-run, which starts no Ray). Inputs of one chunk are tokenized here too: a Ray task would only add
    a worker start."""
    chunks = record_chunks(records, chunk_size)
    head = list(itertools.islice(chunks, 2))
    if in_flight is None or len(head) < 2:
        for chunk in _popping(head, chunks):
            yield from tokenize_records(tokenizer, chunk, max_length=max_length)
        return
    import ray

    # No CPU reserved: tokenizing runs beside the forward actors, which may hold every CPU of a cluster
    # (one CPU actor per core), so `in_flight`, never above the cluster's CPUs, bounds these tasks instead.
    in_flight = max(1, min(in_flight, int(ray.cluster_resources().get("CPU", 1))))
    task = ray.remote(tokenize_chunk).options(num_cpus=0)
    logger.info("tokenizing %d chunks at once (%d records, %d characters of text at most each)", in_flight,
                chunk_size.max_records, chunk_size.max_chars)
    options = {"model_path": model_path, "trust_remote_code": trust_remote_code, "max_length": max_length}
    pending: deque = deque()
    for chunk in _popping(head, chunks):
        pending.append(task.remote(chunk, **options))
        del chunk  # it lives in the object store now, not in the driver
        if len(pending) >= in_flight:
            yield from ray.get(pending.popleft())
    while pending:
        yield from ray.get(pending.popleft())


def _popping(head: list[list[Record]], rest: Iterator[list[Record]]) -> Iterator[list[Record]]:
    """The chunks of `head`, then of `rest`, keeping none once it is handed on."""
    while head:
        yield head.pop(0)
    yield from rest


def form_shards(results: Iterable[tuple[str, dict]], samples_per_shard: int,
                counts: SampleCounts) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(shard index, its samples) for every `samples_per_shard` consecutive samples, and the last, smaller
    one; each sample reduced to what the forward actor stores ({sample_id, input_ids, loss_mask}) and where
    its record is (`where`, for a reject the actor finds). Samples and rejects are added to `counts` as they
    pass."""
    shard: list[dict[str, Any]] = []
    index = 0
    for kind, value in results:
        if kind == "reject":
            counts.rejects.append(value)
            continue
        counts.add(value)
        shard.append({key: value[key] for key in ("sample_id", "input_ids", "loss_mask", "where")})
        if len(shard) == samples_per_shard:
            yield index, shard
            index, shard = index + 1, []
    if shard:
        yield index, shard
