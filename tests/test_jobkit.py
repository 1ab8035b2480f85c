"""The job kit's chunk plan without Ray: committed chunks are kept, the others handed on in order, the
actors started only when a chunk needs them, and a changed input drains the chunks in flight."""
import pytest

from pipeline.jobkit.plan import chunked, run_chunks
from pipeline.jobkit.record_stream import InputChangedError
from pipeline.jobkit.rejects import count_reasons, sorted_rejects


class FakeDispatcher:
    def __init__(self):
        self.submitted, self.finished, self.closed = [], False, False

    def submit(self, index, items):
        self.submitted.append((index, list(items)))

    def finish(self):
        self.finished = True
        return 1.5

    def close(self):
        self.closed = True


def test_chunks_are_consecutive_items_the_last_one_smaller():
    assert list(chunked(range(7), 3)) == [(0, [0, 1, 2]), (1, [3, 4, 5]), (2, [6])]
    assert list(chunked([], 3)) == []


def test_committed_chunks_are_kept_the_others_dispatched_in_order():
    started, kept = [], []
    run = run_chunks(chunked(range(10), 3), committed={1: "info-1"},
                     start_actors=lambda: started.append(FakeDispatcher()) or started[-1],
                     on_kept=lambda index, chunk, info: kept.append((index, chunk, info)))
    [dispatcher] = started
    assert dispatcher.submitted == [(0, [0, 1, 2]), (2, [6, 7, 8]), (3, [9])]
    assert kept == [(1, [3, 4, 5], "info-1")]
    assert (run.chunks, run.kept, run.dispatched, run.seconds) == (4, ["info-1"], 3, 1.5)
    assert dispatcher.finished and dispatcher.closed


def test_no_actor_starts_when_every_chunk_was_committed():
    run = run_chunks(chunked(range(4), 2), committed={0: "a", 1: "b"},
                     start_actors=lambda: pytest.fail("actors started for nothing"))
    assert (run.chunks, run.dispatched, run.seconds) == (2, 0, 0.0)


def test_the_stream_is_read_only_as_far_as_the_chunks_handed_on():
    """The plan pulls the stream lazily: when the second chunk is handed on, only its records were read."""
    read = []

    def records():
        for k in range(100):
            read.append(k)
            yield k

    class Watching(FakeDispatcher):
        def submit(self, index, items):
            super().submit(index, items)
            if index == 1:
                assert len(read) == 20, len(read)

    run_chunks(chunked(records(), 10), committed={}, start_actors=Watching)
    assert len(read) == 100


def test_a_changed_input_waits_for_the_chunks_in_flight_then_stops_the_actors():
    dispatcher = FakeDispatcher()
    checks = iter([None, None, InputChangedError("changed")])

    def check():
        error = next(checks)
        if error:
            raise error

    with pytest.raises(InputChangedError):
        run_chunks(chunked(range(9), 3), committed={}, start_actors=lambda: dispatcher, before_dispatch=check)
    assert [index for index, _ in dispatcher.submitted] == [0, 1]
    assert dispatcher.finished and dispatcher.closed


def test_rejects_of_both_stages_come_out_in_input_order():
    reading = [{"source": "b.jsonl", "index": 0, "reason": "malformed_json"},
               {"source": "a.jsonl", "index": 5, "reason": "too_large"}]
    working = [{"source": "a.jsonl", "index": 2, "reason": "prompt_too_long"}]
    ordered = sorted_rejects(["a.jsonl", "b.jsonl"], reading, working)
    assert [(r["source"], r["index"]) for r in ordered] == [("a.jsonl", 2), ("a.jsonl", 5), ("b.jsonl", 0)]
    assert count_reasons(ordered) == {"malformed_json": 1, "prompt_too_long": 1, "too_large": 1}
