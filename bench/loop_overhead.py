"""What our speculative loop costs beyond its two model calls, beside a plain step (not a test; issue 37 item 4).

Answers the same first turns by plain and by speculative decoding, alternating prompt by prompt in this one
process (a shared machine slows both sides alike), and splits each speculative round into drafting (the tree
builder), the verifying target pass, and the rest: acceptance, moving the accepted path into place in both
caches, the drafter's keys for the committed states, bookkeeping. A plain step is split the same way into
its target pass and the rest. Prints one table row per shape:

  | shape | τ | plain step ms (target pass + rest) | round ms | draft | verify | rest | host reads per round | speedup |

    python bench/loop_overhead.py --drafter RUN/drafter [--model .cache/demo/model]
        [--prompts runs/demo/prompts-by-category.jsonl] [--limit 10] [--max-new-tokens 128] [--dtype float32]
        [--shapes "chain d1,chain d3,tree d5 k4 n16"] [--compile] [--json out.json]

The speedup is tokens/s over whole answers (prefill included), as `eval` reports it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO_MODEL  # noqa: E402
from beagle.decoding import generate  # noqa: E402
from beagle.decoding.draft_vocab import select_draft_vocabulary  # noqa: E402
from beagle.decoding.loading import load_drafter_for, load_target  # noqa: E402
from beagle.decoding.tree import DraftConfig  # noqa: E402
from beagle.devices import DTYPES, pick_device  # noqa: E402
from beagle.prompts import eos_token_ids, load_prompts, render  # noqa: E402

SHAPES = {
    "chain d1": DraftConfig.chain(depth=1),
    "chain d3": DraftConfig.chain(depth=3),
    "tree d5 k4 n16": DraftConfig(depth=5, top_k=4, total_tokens=16),
}


class Clock:
    """Seconds spent inside wrapped functions, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed


@contextmanager
def clocked(clock: Clock):
    """Time the tree builder, the verifying pass, one speculative round and every plain-decoding target call."""
    originals = {name: getattr(generate, name) for name in ("build_draft_tree", "verify_tree", "run_target")}
    step = generate.SpeculativeSession.step
    for name, function in originals.items():
        setattr(generate, name, clock.wrap(name, function))
    generate.SpeculativeSession.step = clock.wrap("round", step)
    try:
        yield clock
    finally:
        for name, function in originals.items():
            setattr(generate, name, function)
        generate.SpeculativeSession.step = step


@contextmanager
def host_reads():
    """Counts `tolist`, `item` and int()/bool() of a tensor (each makes the host wait for the device)."""
    reads = {"count": 0}
    patched = {}
    for name in ("tolist", "item", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads["count"] += 1
            return _original(self, *args, **kwargs)
        patched[name] = original
        setattr(torch.Tensor, name, counted)
    try:
        yield reads
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)


def measure(model, drafter, prompts: list[torch.Tensor], config: DraftConfig, max_new_tokens: int,
            eos: set[int]) -> dict:
    """Both sides over `prompts`, alternating; the split of a plain step and of a round, in ms."""
    plain_seconds = spec_seconds = 0.0
    plain_tokens = spec_tokens = plain_steps = rounds = committed = 0
    plain_clock, spec_clock = Clock(), Clock()
    identical = 0
    for prompt in prompts:
        with clocked(plain_clock):
            plain = generate.plain_generate(model, prompt, max_new_tokens, eos)
        with clocked(spec_clock):
            spec = generate.speculative_generate(model, drafter, prompt, max_new_tokens, eos, config)
        identical += plain.tokens == spec.tokens
        plain_seconds += plain.seconds
        spec_seconds += spec.seconds
        plain_tokens += len(plain.tokens)
        spec_tokens += len(spec.tokens)
        plain_steps += plain.target_passes
        rounds += spec.target_passes
        committed += spec.committed_by_passes
    plain_target = plain_clock.seconds["run_target"]
    prefill_share = plain_target / plain_clock.calls["run_target"]  # a rough split; steps are most calls
    plain_step_ms = 1000 * (plain_seconds - prefill_share * len(prompts)) / max(plain_steps, 1)
    plain_pass_ms = 1000 * (plain_target - prefill_share * len(prompts)) / max(plain_steps, 1)
    round_ms = 1000 * spec_clock.seconds["round"] / rounds
    draft_ms = 1000 * spec_clock.seconds["build_draft_tree"] / rounds
    verify_ms = 1000 * spec_clock.seconds["verify_tree"] / rounds
    with torch.inference_mode(), host_reads() as reads:  # one prompt's rounds, counted outside the timings
        session = generate.SpeculativeSession(model, drafter, config)
        session.prefill(prompts[0])
        reads["count"] = 0
        for _ in range(8):
            session.step()
        reads_per_round = reads["count"] / 8
    return {"tau": committed / rounds, "plain_step_ms": plain_step_ms, "plain_pass_ms": plain_pass_ms,
            "round_ms": round_ms, "draft_ms": draft_ms, "verify_ms": verify_ms,
            "rest_ms": round_ms - draft_ms - verify_ms, "host_reads_per_round": reads_per_round,
            "speedup": (spec_tokens / spec_seconds) / (plain_tokens / plain_seconds),
            "plain_tokens_per_second": plain_tokens / plain_seconds,
            "speculative_tokens_per_second": spec_tokens / spec_seconds,
            "identical": identical, "prompts": len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--drafter", required=True, help="RUN/drafter (native form)")
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parent.parent / "runs" / "demo"
                                                 / "prompts-by-category.jsonl"))
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared machine)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = pick_device(args.device)
    model, tokenizer = load_target(args.model, args.dtype, device)
    drafter, meta = load_drafter_for(args.drafter, model, args.dtype, device)
    eos = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    drafter, _ = select_draft_vocabulary(drafter, meta, None, [], eos)
    items = load_prompts(args.prompts, args.limit).items
    prompts = [torch.tensor(render(tokenizer, list(item.history) + [{"role": "user", "content": item.turns[0]}]),
                            device=device) for item in items]
    warm = [prompts[0]]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, model {args.model} ({args.dtype}), drafter {args.drafter}, "
          f"{torch.get_num_threads()} threads, {len(prompts)} prompts "
          f"(context {statistics.median(len(p) for p in prompts):.0f} tokens median), {args.max_new_tokens} new tokens")
    print("| shape | τ | plain step ms (pass + rest) | round ms | draft | verify | rest | host reads/round | "
          "plain tok/s | spec tok/s | speedup | identical |")
    print("|---" * 12 + "|")
    results = {}
    for name in args.shapes.split(","):
        config = SHAPES[name]
        measure(model, drafter, warm, config, 8, eos)  # warm-up: allocator, lazy init
        r = measure(model, drafter, prompts, config, args.max_new_tokens, eos)
        results[name] = r
        print(f"| {name} | {r['tau']:.2f} | {r['plain_step_ms']:.1f} ({r['plain_pass_ms']:.1f} + "
              f"{r['plain_step_ms'] - r['plain_pass_ms']:.1f}) | {r['round_ms']:.1f} | {r['draft_ms']:.1f} | "
              f"{r['verify_ms']:.1f} | {r['rest_ms']:.2f} | {r['host_reads_per_round']:.1f} | "
              f"{r['plain_tokens_per_second']:.1f} | {r['speculative_tokens_per_second']:.1f} | "
              f"{r['speedup']:.3f}x | {r['identical']}/{r['prompts']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
