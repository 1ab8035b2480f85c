"""The chunk plan of a job and its run: chunks cut from the stream in input order, each either committed
by an earlier run (kept) or handed to the actors, while the stream is still being read.

Chunk boundaries depend only on the inputs and settings (both inside the job's identity), never on Ray
scheduling, so a chunk index names the same work in every run: a rerun after a crash keeps the chunks
committed before it and redoes the rest, and the output is the same bytes as an uninterrupted run's.
The driver reads the stream only as fast as the actors take chunks (`ActorDispatcher.submit` waits while
they are full), and drops each chunk once handed on: its memory does not grow with the inputs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

from pipeline.jobkit.dispatch import ActorDispatcher
from pipeline.jobkit.record_stream import InputChangedError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def chunked(items: Iterable[T], size: int) -> Iterator[tuple[int, list[T]]]:
    """(chunk index, `size` consecutive items) along `items`, the last chunk possibly smaller."""
    chunk: list[T] = []
    index = 0
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield index, chunk
            index, chunk = index + 1, []
    if chunk:
        yield index, chunk


@dataclass
class ChunkRun:
    """What running a chunk plan did."""

    chunks: int = 0  # chunks formed
    kept: list[Any] = field(default_factory=list)  # what `committed` said of each chunk kept, in order
    dispatched: int = 0  # chunks handed to the actors in this run
    seconds: float = 0.0  # the actors' wall time: first chunk handed on to the last result


def run_chunks(chunks: Iterable[tuple[int, Any]], *, committed: Mapping[int, Any],
               start_actors: Callable[[], ActorDispatcher], on_kept: Callable[[int, Any, Any], None] | None = None,
               before_dispatch: Callable[[], None] | None = None) -> ChunkRun:
    """Keep the chunks `committed` holds (calling `on_kept(index, chunk, committed[index])`), hand the others
    to the actors as they form; the actors start with the first chunk that needs them.

    `before_dispatch()` runs before each chunk is handed on (a job refuses inputs that changed there). On
    `InputChangedError` the chunks in flight are waited for first, so that no actor commits one after the
    caller has discarded this run's work; on any other error the actors are stopped at once."""
    run = ChunkRun()
    dispatcher: ActorDispatcher | None = None
    try:
        for index, chunk in chunks:
            run.chunks = index + 1
            if index in committed:
                run.kept.append(committed[index])
                if on_kept is not None:
                    on_kept(index, chunk, committed[index])
                continue
            if before_dispatch is not None:
                before_dispatch()
            if dispatcher is None:
                dispatcher = start_actors()
            dispatcher.submit(index, chunk)
            run.dispatched += 1
            del chunk  # it lives in the object store now, not in the driver
        run.seconds = dispatcher.finish() if dispatcher is not None else 0.0
    except InputChangedError:
        if dispatcher is not None:
            try:
                dispatcher.finish()
            except Exception:  # noqa: BLE001 - the changed input is the error to report
                logger.exception("while waiting for the chunks in flight after an input changed")
        raise
    finally:
        if dispatcher is not None:
            dispatcher.close()
    return run
