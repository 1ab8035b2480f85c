"""P11 (not a test): regeneration's generated tokens/s against a bare batched greedy decode loop.

Both run in this process on the demo target, same dtype, threads, prompts (first turns of ShareGPT
conversations, rendered with the chat template), batch size and length-sorted batches:
- regenerate: `ConversationGenerator.answer` (transformers `generate`, what `regenerate` runs per chunk);
- bare: left-padded prefill, then one token per step for the whole batch with a DynamicCache, argmax, stop
  when every row has ended; the same answer lengths are counted (tokens up to EOS or the limit).
P11 = regenerate tokens/s ÷ bare tokens/s (target ≥ 0.8). Greedy, so both produce the same answers.

    python bench/regenerate.py [--prompts 64] [--batch-size 32] [--max-new-tokens 128] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from beagle.decoding.verify import _cache_keyword  # noqa: E402

from bench.common import DEMO_MODEL, DEMO_SHAREGPT, emit, record, require_demo  # noqa: E402
from beagle.prompts import render  # noqa: E402
from pipeline.regenerate.generation import ConversationGenerator, GenerateConfig  # noqa: E402
from pipeline.regenerate.prompts import PromptRecord  # noqa: E402


def _records(count: int, max_prompt_length: int, tokenizer) -> list[PromptRecord]:
    """The first `count` ShareGPT conversations whose first human turn fits `max_prompt_length` tokens."""
    out = []
    for index, line in enumerate(DEMO_SHAREGPT.read_text(encoding="utf-8").split("\n")):
        if len(out) == count:
            break
        turns = [m["value"] for m in json.loads(line).get("conversations", []) if m.get("from") == "human"]
        if turns and turns[0].strip() and len(render(tokenizer, [{"role": "user", "content": turns[0]}])) \
                <= max_prompt_length:
            out.append(PromptRecord(f"p{index}", "sharegpt", index, (), (turns[0],)))
    return out


@torch.inference_mode()
def bare_greedy(model, prompts: list[list[int]], pad_id: int, eos_ids: set[int], max_new_tokens: int) -> int:
    """Greedy-decode one left-padded batch step by step; returns the answer tokens (up to EOS) produced."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)                                  # [B, W]
    cache = {_cache_keyword(model): DynamicCache(config=model.config)}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                   **cache).logits[:, -1]                                            # [B, V]
    eos = torch.tensor(sorted(eos_ids))
    alive = torch.ones(len(prompts), dtype=torch.bool)
    produced = 0
    for _ in range(max_new_tokens):
        token = logits.argmax(-1)                                                    # [B]
        ended = torch.isin(token, eos)
        produced += int((alive & ~ended).sum())
        alive &= ~ended
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                       **cache).logits[:, -1]
    return produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-length", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_demo()
    config = GenerateConfig(model_path=str(DEMO_MODEL), dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                            max_prompt_length=args.max_prompt_length, batch_size=args.batch_size, device="cpu")
    generator = ConversationGenerator(config)
    records = _records(args.prompts, args.max_prompt_length, generator.tokenizer)
    generator.answer(records[:2], seed=0)                                            # warm-up
    start = time.perf_counter()
    answered = generator.answer(records, seed=0)
    regen_seconds = time.perf_counter() - start
    regen_tokens = sum(a.generated_tokens for a in answered)

    prompts = sorted((render(generator.tokenizer, [{"role": "user", "content": r.turns[0]}]) for r in records), key=len)
    start = time.perf_counter()
    bare_tokens = sum(bare_greedy(generator.model, prompts[i:i + args.batch_size], generator.pad_id, generator.eos_ids,
                                  args.max_new_tokens) for i in range(0, len(prompts), args.batch_size))
    bare_seconds = time.perf_counter() - start
    regen_rate, bare_rate = regen_tokens / regen_seconds, bare_tokens / bare_seconds
    settings = {"prompts": len(records), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                "dtype": args.dtype, "threads": torch.get_num_threads(),
                "tokens": {"regenerate": regen_tokens, "bare": bare_tokens}}
    emit([record("P11", "regenerate ÷ bare batched greedy tokens/s", regen_rate / bare_rate, 0.8, ">=",
                  f"{regen_rate:,.0f} vs {bare_rate:,.0f} generated tokens/s", settings,
                  why="transformers `generate` adds per-step work (logits processors, stopping criteria) to a "
                      "step that is only ~50 ms on this CPU")], args.json)


if __name__ == "__main__":
    main()
