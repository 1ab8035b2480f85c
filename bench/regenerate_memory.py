"""Not a test: the `regenerate` driver's peak resident memory on N prompts and on 10·N prompts.

A driver that streams its inputs to the actors holds a few chunks at a time, whatever the size of the
inputs; one that reads every record first (`list(stream)`) and pickles them into Ray Data rows grows with
them. Each prompt record here is small to answer and large to hold: a short first turn, answered with a
few tokens by a tiny random target, and a 64 KB second turn, which its history pushes past
--max-prompt-length, so it is skipped (counted as a dropped turn) after one tokenization. N records are
N x 64 KB of prompt text in the driver if it keeps them.

Each size runs in a fresh driver process (peak RSS only grows), a real `run_regenerate` on a local Ray with
one CPU actor. The code measured is whatever `pipeline` the child imports, so the same script measures
another checkout: `PYTHONPATH=/path/to/checkout python bench/regenerate_memory.py`.

    python bench/regenerate_memory.py [--prompts 100] [--factor 10] [--chunk-size 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Appended, not inserted: a checkout named by PYTHONPATH is the one measured.
sys.path.append(str(Path(__file__).resolve().parent.parent))

LONG_TURN = "The capital of France is Paris. " * 2048  # 64 KB


def write_prompts(path: Path, records: int) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(records):
            handle.write(json.dumps({"id": f"p{index}", "turns": [f"Question {index}: what is {index} plus {index}?",
                                                                   f"Record {index}. " + LONG_TURN]}) + "\n")
    return path


def child(args: argparse.Namespace) -> None:
    """One driver: run regenerate, print its peak RSS (MiB) and counts as one JSON line."""
    import pipeline
    from beagle.host_memory import peak_rss_mib
    from pipeline.regenerate.generation import GenerateConfig
    from pipeline.regenerate.job import RegenerateConfig, run_regenerate

    generate = GenerateConfig(model_path=args.target, dtype="float32", max_new_tokens=4, max_prompt_length=256,
                              batch_size=32)
    config = RegenerateConfig(generate=generate, data=(args.data,), out=args.out, chunk_size=args.chunk_size,
                              num_workers=1)
    started = time.perf_counter()
    summary = run_regenerate(config)
    print(json.dumps({"peak_rss_mib": peak_rss_mib(), "conversations": summary.conversations,
                      "dropped_turns": summary.dropped_turns, "seconds": time.perf_counter() - started,
                      "code": str(Path(pipeline.__file__).resolve().parent.parent)}))


def measure(target: Path, data: Path, out: Path, chunk_size: int) -> dict:
    command = [sys.executable, __file__, "--child", "--target", str(target), "--data", str(data), "--out", str(out),
               "--chunk-size", str(chunk_size)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from tests.tiny import build_target

    with tempfile.TemporaryDirectory(prefix="regenerate-memory-") as tmp:
        root = Path(tmp)
        target = build_target(root / "target", template="chatml")
        runs = []
        for records in (args.prompts, args.prompts * args.factor):
            data = write_prompts(root / f"prompts-{records}.jsonl", records)
            result = measure(target, data, root / f"answers-{records}.jsonl", args.chunk_size)
            assert result["conversations"] == records, result
            runs.append({"prompts": records, "prompt_mib": data.stat().st_size / 2**20, **result})
            print(f"{records:>6} prompts ({runs[-1]['prompt_mib']:.1f} MiB of input): driver peak "
                  f"{result['peak_rss_mib']:,.0f} MiB in {result['seconds']:.0f}s  [{result['code']}]", flush=True)
    ratio = runs[1]["peak_rss_mib"] / runs[0]["peak_rss_mib"]
    print(f"{args.factor}x the prompts: driver peak x{ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "ratio": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
