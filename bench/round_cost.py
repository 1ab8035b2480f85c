"""What one speculative round costs on this machine, and so what τ a speedup needs (not a test).

Speculative decoding pays when τ (tokens per round) exceeds the round's cost in plain steps. A round is
drafting (d drafter steps, or a tree) plus one target pass over the drafted tokens; a plain step is one
target pass over one token. On a GPU the pass over n tokens costs about what one token costs; on a CPU it
does not, and how much it costs depends on the dtype the cores multiply natively (AMX runs bf16 several
times faster than fp32). Measured side by side in one run, per dtype, after a context of --context tokens:

  | dtype | plain step ms | verify n tokens ms (n = 2, 4, 8, 16) | draft round ms | round ÷ plain | τ for 1.0x / 1.2x |

    python bench/round_cost.py [--model .cache/demo/model] [--context 300] [--draft-vocab 8192]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO_MODEL, require_demo  # noqa: E402
from bench.decode import untrained_drafter  # noqa: E402
from beagle.decoding.draft_vocab import trained_vocabulary  # noqa: E402
from beagle.decoding.drafters import draft_backend  # noqa: E402
from beagle.decoding.kv_cache import truncate_cache  # noqa: E402
from beagle.decoding.packed_linear import pack_for_decoding  # noqa: E402
from beagle.decoding.loading import load_target  # noqa: E402
from beagle.decoding.tree import DraftConfig, build_draft_tree  # noqa: E402
from beagle.decoding.verify import new_cache, run_target, verify_tree  # noqa: E402
from beagle.precision import cpu_has_native_bf16  # noqa: E402

VERIFIED = (1, 2, 4, 8, 16)
# Whole shapes, never cut by confidence: what a round costs when it drafts all it can.
ROUNDS = {"chain d3": DraftConfig.chain(depth=3), "tree d5 k4 n16": DraftConfig(depth=5, top_k=4, total_tokens=16)}
WARM_UP = 2  # calls left out of every median (first-call allocations, lazy initialisation)


def median_ms(seconds: list[float]) -> float:
    """Median in ms of timings taken `WARM_UP` calls and more, the warm-up calls left out."""
    return 1000 * statistics.median(seconds[WARM_UP:])


def timed_ms(run, repeats: int) -> float:
    """Median wall time of `run()` in ms over `repeats` calls after the warm-up."""
    seconds = []
    for _ in range(repeats + WARM_UP):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return median_ms(seconds)


@torch.inference_mode()
def measure(model_path: str, dtype: str, context: int, draft_vocab: int, repeats: int) -> dict:
    """Target passes over n tokens after `context` tokens, and a draft round of each shape, in `dtype`."""
    device = torch.device("cpu")
    model, _ = load_target(model_path, dtype, device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=generator)
    cache = new_cache(model)
    prefill = run_target(model, cache, prompt)
    past = torch.arange(context)

    def target_pass(n: int) -> None:
        tokens = torch.randint(0, model.config.vocab_size, (n,), generator=generator)
        run_target(model, cache, tokens, context + torch.arange(n), hidden=n > 1, last_logits_only=n == 1)
        truncate_cache(cache, context)  # back to the context for the next call

    passes = {n: timed_ms(lambda n=n: target_pass(n), repeats) for n in VERIFIED}
    drafter = untrained_drafter(model, dtype, device)
    if draft_vocab:
        drafter = trained_vocabulary(drafter, list(range(draft_vocab)), set())  # the cost of a reduced head
    pack_for_decoding(drafter)  # as eval drafts (beagle/decoding/packed_linear.py)
    backend = draft_backend(drafter, True)
    backend.append(prefill.hidden.to(next(drafter.parameters()).dtype), past, prompt)
    rounds = {}
    for shape, config in ROUNDS.items():
        draft, verify = [], []
        for _ in range(repeats + WARM_UP):
            started = time.perf_counter()
            tree = build_draft_tree(backend, int(prompt[-1]), context, config)
            drafted = time.perf_counter()
            verify_tree(model, cache, tree, context)
            verified = time.perf_counter()
            truncate_cache(cache, context)
            draft.append(drafted - started)
            verify.append(verified - drafted)
        draft_ms, verify_ms = median_ms(draft), median_ms(verify)
        rounds[shape] = {"verified": int(tree.tokens.numel()), "draft_ms": draft_ms, "verify_ms": verify_ms,
                         "ratio": (draft_ms + verify_ms) / passes[1]}
    return {"passes": passes, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="0: the whole vocabulary")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    require_demo()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d')}, {torch.get_num_threads()} threads, native bf16: "
          f"{'yes' if cpu_has_native_bf16() else 'no'}, context {args.context}, draft vocabulary "
          f"{args.draft_vocab or 'all'}; ms are medians of {args.repeats}")
    print("| dtype | plain step | " + " | ".join(f"verify {n}" for n in VERIFIED[1:])
          + " | round | draft | verify | round ÷ plain | τ for 1.0x / 1.2x |")
    print("|---" * (len(VERIFIED) + 6) + "|")
    for dtype in ("bfloat16", "float32"):
        figures = measure(args.model, dtype, args.context, args.draft_vocab, args.repeats)
        passes = figures["passes"]
        for shape, cost in figures["rounds"].items():
            print(f"| {dtype} | {passes[1]:.1f} | " + " | ".join(f"{passes[n]:.1f}" for n in VERIFIED[1:])
                  + f" | {shape} ({cost['verified']} verified) | {cost['draft_ms']:.1f} | {cost['verify_ms']:.1f} | "
                  f"{cost['ratio']:.2f} | {cost['ratio']:.2f} / {1.2 * cost['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
