"""P11 (not a test): regeneration's generated tokens/s against a bare batched greedy decode loop.

Both run in this process on the demo target, same dtype, threads, prompts (first turns of ShareGPT
conversations, rendered with the chat template), batch size and length-sorted batches:
- regenerate: `ConversationGenerator.answer` (transformers `generate`, what `regenerate` runs per chunk);
- bare: left-padded prefill, then one token per step for the whole batch with a DynamicCache, argmax, stop
  when every row has ended; the same answer lengths are counted (tokens up to EOS or the limit).
P11 = regenerate tokens/s ÷ bare tokens/s (target ≥ 0.8). Greedy, so both produce the same answers.

`--engine vllm` (or `both`) measures P16 instead: regenerate's own `ConversationGenerator.answer` with
`--engine vllm` (vllm.LLM in its worker process, .venv-vllm) against `--engine hf`, same prompts, dtype, batch
size (vLLM: max_num_seqs) and answer length, one run each in a fresh child process, one after the other
(hf first). Each child loads its engine, answers two prompts as a warm-up, then all of them, timed. Memory:
the peak of the child's process tree (vLLM: the child, its worker and vLLM's engine processes), sampled by
this process every 0.5 s as the sum of RSS (/proc/PID/statm: pages shared between processes, such as torch's
libraries, counted in each, so an upper bound; reading PSS from smaps every 0.2 s stalled the measured
process, whose allocations wait on the same memory-map lock).
P16 = vLLM tokens/s ÷ hf tokens/s over the timed answers (target ≥ 2.0); the load time and the ratio with
it included are reported beside it.

    python bench/regenerate.py [--prompts 64] [--batch-size 32] [--max-new-tokens 128] [--json out.json]
    python bench/regenerate.py --engine both [--prompts 64] [--max-new-tokens 192] [--json p16.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from beagle.decoding.verify import _cache_keyword  # noqa: E402

from bench.common import DEMO_MODEL, DEMO_SHAREGPT, emit, record, require_demo, run_measured  # noqa: E402
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


def engine_child(args: argparse.Namespace) -> None:
    """One engine in this (fresh) process: load, warm up on two prompts, answer all; one JSON line."""
    started = time.perf_counter()
    config = GenerateConfig(model_path=str(DEMO_MODEL), dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                            max_prompt_length=args.max_prompt_length, batch_size=args.batch_size, device="cpu",
                            engine=args.child)
    generator = ConversationGenerator(config)
    records = _records(args.prompts, args.max_prompt_length, generator.tokenizer)
    generator.answer(records[:2], seed=0)                                            # warm-up
    load_seconds = time.perf_counter() - started
    start = time.perf_counter()
    answered = generator.answer(records, seed=0)
    seconds = time.perf_counter() - start
    version = getattr(generator.engine, "version", None) or __import__("transformers").__version__
    print(json.dumps({"engine": args.child, "version": version, "prompts": len(records), "load_seconds": load_seconds,
                      "seconds": seconds, "tokens": sum(a.generated_tokens for a in answered),
                      "unfinished": sum(a.unfinished_turns for a in answered),
                      "answers": [a.messages[-1]["content"] for a in answered], "threads": torch.get_num_threads()}))
    if hasattr(generator.engine, "close"):
        generator.engine.close()


def measure_engine(engine: str, args: argparse.Namespace) -> dict:
    """Run `engine_child` for `engine` in a fresh interpreter, sampling its process tree's memory."""
    command = [sys.executable, __file__, "--child", engine, "--prompts", str(args.prompts), "--batch-size",
               str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-length",
               str(args.max_prompt_length), "--dtype", args.dtype]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(x for x in (str(Path(__file__).resolve().parent.parent),
                                                     os.environ.get("PYTHONPATH", "")) if x)}
    out, seconds, peak = run_measured(command, env, f"{engine} child")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "process_seconds": seconds, "peak_rss_mib": peak}


def p16(args: argparse.Namespace) -> None:
    runs = {}
    for engine in ("hf", "vllm") if args.engine == "both" else ("vllm",):
        runs[engine] = measure_engine(engine, args)
        r = runs[engine]
        print(f"{engine} {r['version']}: {r['tokens']:,} tokens in {r['seconds']:.1f}s = "
              f"{r['tokens'] / r['seconds']:,.1f} tokens/s (load + warm-up {r['load_seconds']:.1f}s); peak memory "
              f"{r['peak_rss_mib']:,.0f} MiB (RSS summed over its processes)", flush=True)
    if len(runs) < 2:
        return
    hf, vllm = runs["hf"], runs["vllm"]
    rate = {k: r["tokens"] / r["seconds"] for k, r in runs.items()}
    with_load = {k: r["tokens"] / (r["seconds"] + r["load_seconds"]) for k, r in runs.items()}
    identical = sum(a == b for a, b in zip(hf["answers"], vllm["answers"]))
    settings = {"prompts": hf["prompts"], "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                "dtype": args.dtype, "threads": hf["threads"], "identical_answers": identical,
                "runs": {k: {key: value for key, value in r.items() if key != "answers"} for k, r in runs.items()},
                "ratio_with_load": with_load["vllm"] / with_load["hf"],
                "memory_ratio": vllm["peak_rss_mib"] / hf["peak_rss_mib"]}
    emit([record("P16", "regenerate tokens/s, vLLM ÷ hf", rate["vllm"] / rate["hf"], 2.0, ">=",
                  f"{rate['vllm']:,.1f} vs {rate['hf']:,.1f} generated tokens/s ({with_load['vllm'] / with_load['hf']:.2f}x "
                  f"with loading); peak RSS {vllm['peak_rss_mib']:,.0f} vs {hf['peak_rss_mib']:,.0f} MiB; "
                  f"{identical}/{hf['prompts']} answers identical", settings,
                  why="vLLM's CPU build on 2 shared cores")], args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-length", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm", "both"],
                        help="hf: P11 (regenerate ÷ a bare loop); vllm / both: P16 (vLLM ÷ hf)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, choices=["hf", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_demo()
    if args.child:
        engine_child(args)
        return
    if args.engine != "hf":
        p16(args)
        return
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
