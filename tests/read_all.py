"""Extraction's inputs read whole into memory, for tests: the jobs stream them (`scan_inputs` then
`stream_inputs`) and never hold every record."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from beagle.records import DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_TURNS
from pipeline.extract.inputs import Record, normalize_record
from pipeline.jobkit.record_stream import RecordStream


@dataclass
class ReadResult:
    records: list[Record] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    sources: list[dict[str, Any]] = field(default_factory=list)  # {"path", "sha256", "records"}


def read_inputs(paths: list[str], *, limit: int | None = None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                max_turns: int | None = DEFAULT_MAX_TURNS) -> ReadResult:
    """Every input in order, read into memory; stops once `limit` usable records are collected."""
    stream = RecordStream(paths, normalize_record, limit=limit, max_record_bytes=max_record_bytes,
                          max_turns=max_turns)
    records = list(stream)
    return ReadResult(records, stream.rejects, stream.sources)
