"""Benchmark speculative decoding against plain decoding (not a test): tokens/s ratio and τ.

For each draft shape (a chain and two trees by default) the same prompts are answered by plain decoding
and by speculative decoding in this one process, and a table is printed:
  shape | τ (tokens per target pass) | α per depth | plain tok/s | speculative tok/s | speedup | identical outputs
(in bf16, one-token and many-token passes can round an argmax differently: equality is tested in fp32)

    python bench/decode.py --drafter RUN/drafter [--model .cache/demo/model] [--prompts question.jsonl]
                           [--limit 4] [--max-new-tokens 64] [--dtype bfloat16] [--drafter-dtype bfloat16]
                           [--draft-vocab 8192 [--draft-vocab-store STORE]]

Without --drafter an UNTRAINED drafter of the right shape is used: τ is then ~1 and the table shows only
the cost of drafting and tree verification on this machine (the break-even τ for each shape).
"""
from __future__ import annotations

import argparse
import time

import torch

from beagle.decoding import DraftConfig
from beagle.decoding.draft_vocab import select_draft_vocabulary
from beagle.decoding.evaluation import evaluate_prompts
from beagle.decoding.loading import load_drafter_for, load_target
from beagle.devices import DTYPES, pick_device
from beagle.model import BeagleDrafter, DrafterConfig
from beagle.prompts import eos_token_ids, load_prompts

SHAPES = {
    "chain d5": DraftConfig.chain(depth=5),
    "tree d5 k4 n16": DraftConfig(depth=5, top_k=4, total_tokens=16),
    "tree d5 k10 n60": DraftConfig(depth=5, top_k=10, total_tokens=60),
    # Confidence-gated (`eval --min-confidence`): a weak drafter drafts only where it is sure.
    "chain d3 c0.25": DraftConfig.chain(depth=3, min_confidence=0.25),
    "tree d5 k4 n16 c0.2": DraftConfig(depth=5, top_k=4, total_tokens=16, min_confidence=0.2),
}


def untrained_drafter(model: torch.nn.Module, dtype: str, device: torch.device) -> BeagleDrafter:
    """A drafter of the target's shape with random weights: it costs what a trained one costs."""
    torch.manual_seed(0)
    return BeagleDrafter(DrafterConfig.from_architecture(model.config.to_dict()),
                         model.get_input_embeddings().weight.detach(),
                         model.get_output_embeddings().weight.detach()).to(device, DTYPES[dtype]).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".cache/demo/model")
    parser.add_argument("--drafter", default=None, help="RUN/drafter; omitted = untrained drafter (overhead only)")
    parser.add_argument("--prompts", default=".cache/demo/mtbench/question.jsonl")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--drafter-dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="score only the N most frequent tokens (default: the drafter's trained vocabulary, else all)")
    parser.add_argument("--draft-vocab-store", action="append", default=[],
                        help="store(s) to count tokens in (default: the drafter's training stores)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    model, tokenizer = load_target(args.model, args.dtype, device)
    drafter_dtype = args.drafter_dtype or args.dtype
    meta: dict = {}
    if args.drafter:
        drafter, meta = load_drafter_for(args.drafter, model, drafter_dtype, device)
        which = args.drafter
    else:
        drafter = untrained_drafter(model, drafter_dtype, device)
        which = "untrained drafter (overhead only)"
    eos = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    drafter, vocabulary_note = select_draft_vocabulary(drafter, meta, args.draft_vocab, args.draft_vocab_store, eos)
    if vocabulary_note:
        which += f", {vocabulary_note}"
    items = load_prompts(args.prompts, args.limit).items
    items = [type(item)(item.prompt_id, item.history, item.turns[:1]) for item in items]  # first turns only

    print(f"model {args.model} ({args.dtype}), drafter {which} ({drafter_dtype}), device {device}, "
          f"threads {torch.get_num_threads()}, {len(items)} prompts, max {args.max_new_tokens} new tokens, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| shape | τ | α per depth | plain tok/s | speculative tok/s | speedup | identical outputs |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        summary = evaluate_prompts(model, drafter, tokenizer, items, SHAPES[name], args.max_new_tokens, eos)
        report = summary.to_json()
        alphas = " ".join("-" if a is None else f"{a:.2f}" for a in summary.per_depth_acceptance)
        print(f"| {name} | {summary.acceptance_length:.2f} | {alphas} | "
              f"{report['tokens_per_second']['baseline']:.1f} | {report['tokens_per_second']['speculative']:.1f} | "
              f"{summary.speedup:.2f}x | {len(items) - len(summary.mismatches)}/{len(items)} |",
              flush=True)


if __name__ == "__main__":
    main()
