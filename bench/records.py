"""How fast the one records reader reads inputs, side by side with the standard library on the same file.

    python bench/records.py [--conversations 20000]

Writes a synthetic ShareGPT-shaped data set as a JSON array and as JSONL, then times, in one run:
`json.load` of the whole array (the fastest a reader holding everything in memory can be), the records
reader's streaming JSON array path (ijson events built into records, bounded memory, with its guards) and
its JSONL path. Prints MB/s and the ratios to `json.load`; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from beagle.records import iter_raw_records  # noqa: E402


def _conversation(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i}: " + "how does speculative decoding work? é ✓ " * 20},
        {"from": "gpt", "value": "It drafts tokens cheaply and verifies them in one pass. " * 40}]}


def _best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [_conversation(i) for i in range(args.conversations)]
    with tempfile.TemporaryDirectory() as folder:
        array, lines = Path(folder) / "data.json", Path(folder) / "data.jsonl"
        array.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
        lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        size_mb = array.stat().st_size / 1e6

        def stdlib() -> None:
            assert len(json.loads(array.read_bytes())) == len(rows)

        def streamed(path: Path):
            def run() -> None:
                assert sum(1 for _ in iter_raw_records(path)) == len(rows)
            return run

        base = _best_of(args.repeats, stdlib)
        results = [("json.load, whole file in memory", base),
                   ("records reader, JSON array (ijson, streamed)", _best_of(args.repeats, streamed(array))),
                   ("records reader, JSONL (line by line)", _best_of(args.repeats, streamed(lines)))]
    print(f"{args.conversations:,} conversations, {size_mb:.1f} MB; best of {args.repeats}")
    for name, seconds in results:
        print(f"  {name:46s} {size_mb / seconds:7.1f} MB/s  {base / seconds:5.2f}x json.load")


if __name__ == "__main__":
    main()
