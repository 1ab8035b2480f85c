"""Inputs read with bounds: a line with no end costs --max-record-bytes of memory, not its size, and a
conversation of absurdly many turns is rejected before its loss mask is searched for."""
from __future__ import annotations

import json
import time
import tracemalloc

import pytest
from click.testing import CliRunner

from pipeline.cli import main as cli_main
from beagle.records import RejectReason
from tests.read_all import read_inputs

REJECT_REASONS = {reason.value for reason in RejectReason}


def test_a_huge_line_is_rejected_having_read_no_more_than_the_limit_at_once(tmp_path):
    """64 MiB with no newline, then two good lines, with --max-record-bytes 1 MiB: the long line is a
    too_large reject with its true size, the lines after it are read, and reading never held more than
    a fraction of the line (it was never in memory whole)."""
    path = tmp_path / "huge.jsonl"
    good = json.dumps({"text": "after the long line"}) + "\n"
    with open(path, "wb") as handle:
        block = b"x" * (1 << 20)
        for _ in range(64):
            handle.write(block)
        handle.write(b"\n" + good.encode() + good.replace("after", "and after").encode())
    tracemalloc.start()
    try:
        result = read_inputs([str(path)], max_record_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(r["reason"], r["line"]) for r in result.rejects] == [("too_large", 1)]
    assert f"{(64 << 20) + 1:,} bytes" in result.rejects[0]["detail"]
    assert [r.text for r in result.records] == ["after the long line", "and after the long line"]
    assert [r.line for r in result.records] == [2, 3]
    assert peak < 32 << 20, f"peak {peak / 2**20:.0f} MiB"  # the limit, a block, and the hash's 8 MiB reads


@pytest.mark.timeout(60)
def test_a_conversation_of_too_many_turns_is_rejected_before_it_is_tokenized(tmp_path):
    """10^5 one-character turns (81 s of mask search before, unbounded at 10^6): rejected as
    too_many_turns at once, by the reader and by a real `extract --dry-run`; --max-turns moves the bound."""
    from tests.tiny import build_target

    assert "too_many_turns" in REJECT_REASONS
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(100_000)]
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"id": "long", "messages": turns}) + "\n" +
                    json.dumps({"id": "short", "messages": turns[:6]}) + "\n")
    started = time.perf_counter()
    result = read_inputs([str(data)])
    assert [(r["reason"], r["line"]) for r in result.rejects] == [("too_many_turns", 1)]
    assert "100,000 turns, more than --max-turns 1,024" in result.rejects[0]["detail"]
    assert [r.sample_id for r in result.records] == ["short"]
    assert read_inputs([str(data)], max_turns=4).records == []

    target = build_target(tmp_path / "target", template="chatml_generation")
    dry = CliRunner().invoke(cli_main, ["extract", "--model", str(target), "--data", str(data), "--out",
                                        str(tmp_path / "store"), "--dry-run", "--no-progress"])
    assert dry.exit_code == 0, dry.output
    assert "too_many_turns" in dry.output and "samples      1" in dry.output, dry.output
    assert time.perf_counter() - started < 30


def test_a_utf8_bom_opening_a_json_array_or_jsonl_file_is_not_a_record(tmp_path):
    """Windows editors open files with a BOM: a JSON array holding two records used to become one
    malformed_json reject ("all 1 records were rejected" for a file of 2)."""
    import json

    from beagle.records.files import iter_raw_records

    records = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(2)]
    array, lines = tmp_path / "a.json", tmp_path / "l.jsonl"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(records).encode())
    lines.write_bytes(b"\xef\xbb\xbf" + "\n".join(map(json.dumps, records)).encode())
    for path in (array, lines):
        read = list(iter_raw_records(path))
        assert [obj for _, obj, reject, _ in read] == records and not any(reject for _, _, reject, _ in read)


def test_a_damaged_parquet_file_is_named_in_one_line(tmp_path):
    import pytest

    from beagle.errors import InputError
    from beagle.records.files import iter_raw_records

    path = tmp_path / "chats.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match=r"chats\.parquet: not a readable Parquet file"):
        list(iter_raw_records(path))
