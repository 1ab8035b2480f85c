"""Rejects of a job: put in input order and counted by reason, the same way for every job.

A job meets rejects at two times, reading (`RecordStream.rejects`) and working (a tokenizer or a prompt
too long, found on the actors); the rejects file lists both together in input order, so that it reads
like the inputs whatever the order chunks finished in.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Sequence


def sorted_rejects(paths: Sequence[str], *parts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rejects of every part together, in input order (the file's place in `paths`, then the record)."""
    order = {path: i for i, path in enumerate(paths)}
    return sorted((r for part in parts for r in part), key=lambda r: (order.get(r["source"], 0), r["index"]))


def count_reasons(rejects: Iterable[dict[str, Any]]) -> dict[str, int]:
    """{reason: count}, reasons sorted: what manifests and summaries report."""
    return dict(sorted(Counter(r["reason"] for r in rejects).items()))


def format_reasons(counts: dict[str, int]) -> str:
    """'malformed_json 2, too_large 1': a count of rejects by reason, on one line."""
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))
