"""One vLLM run of a target, plain or with a speculative drafter; runs INSIDE the vLLM venv (make serve-venv).

    .venv-vllm/bin/python bench/serve_vllm.py --target .cache/demo/model [--drafter DIR --method eagle3]
        [--num-speculative-tokens 3] [--dtype float32|bfloat16] --prompts question.jsonl [--limit 10]
        [--max-new-tokens 64] [--temperature 0.7 --top-p 1.0 --samples 1] [--concurrency 1] [--by category]
        --out run.json

This file imports nothing from the project (the vLLM venv does not have it): bench/serve.py starts it as a
subprocess and compares the runs. Prompts are MT-Bench style JSONL ({"turns": [...]}, first turn used;
{"prompt": ...} and {"messages": [...]} are taken too), rendered with the target's chat template
(add_generation_prompt=True) and passed to vLLM as token ids. Answers are greedy by default (temperature 0),
one prompt at a time (concurrency 1, the latency setting speculative decoding is for), after one warm-up
prompt that is not counted. `--concurrency N` runs the prompts in waves of N requests in flight together
(`max_num_seqs` N; a wave ends with its slowest request), `--temperature`/`--top-p` sample (each request
seeded: `--seed` + its index), `--samples S` asks every prompt S times (the distribution check of
bench/serve.py). Writes per-request output token ids, latency (queued to last token, vLLM's own request
timestamps) and group (the record's `--by` field), output tokens/s over all requests, the speculative-decoding
counters of `LLM.get_metrics()` (differences over the timed requests only: acceptance length = 1 + accepted /
drafts, acceptance at position j = accepted_per_pos[j] / drafts) and, per request, vLLM's per-request
acceptance histogram (`per_request_spec_decode_metrics="summary"`), from which bench/serve.py sums groups.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
SPEC_VECTOR = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target model folder (Hugging Face layout)")
    p.add_argument("--drafter", default=None, help="drafter folder (speculators format); none = plain decoding")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "eagle"])
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", required=True, help="JSONL: {'turns': [...]} (first turn), 'prompt' or 'messages'")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="request i is seeded with seed + i (sampling); -1: unseeded")
    p.add_argument("--samples", type=int, default=1, help="ask every prompt this many times")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight together (max_num_seqs)")
    p.add_argument("--by", default="category", help="record field saved as each request's group")
    p.add_argument("--out", required=True, help="JSON file to write")
    return p.parse_args(argv)


def load_messages(path: str, limit: int, by: str | None = None) -> tuple[list[list[dict]], list[str | None]]:
    """(the first user turn of each usable record, each record's `by` field as a string or None)."""
    conversations, groups = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("turns"):
                messages = [{"role": "user", "content": record["turns"][0]}]
            elif record.get("messages"):
                messages = [m for m in record["messages"] if m.get("role") != "assistant"][:1] or record["messages"][:1]
            elif record.get("prompt"):
                messages = [{"role": "user", "content": record["prompt"]}]
            else:
                continue
            conversations.append(messages)
            value = record.get(by) if by else None
            groups.append(None if value is None or isinstance(value, (dict, list)) else str(value))
            if limit and len(conversations) >= limit:
                break
    return conversations, groups


def spec_metrics(llm) -> dict:
    """Sum the speculative-decoding counters over label sets (one per engine); {} when none exist."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS and isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0) + int(metric.value)
        elif metric.name == SPEC_VECTOR and isinstance(metric, Vector):
            previous, values = out.get(metric.name, []), [int(v) for v in metric.values]
            out[metric.name] = [(previous[i] if i < len(previous) else 0) + (values[i] if i < len(values) else 0)
                                for i in range(max(len(previous), len(values)))]
    return out


def difference(after: dict, before: dict) -> dict:
    diff = {}
    for name, value in after.items():
        if isinstance(value, list):
            old = before.get(name, [0] * len(value))
            diff[name] = [a - (old[i] if i < len(old) else 0) for i, a in enumerate(value)]
        else:
            diff[name] = value - before.get(name, 0)
    return diff


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile of sorted `values` (None for none)."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, int(-(-len(values) * q // 100)) - 1))]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    started = time.perf_counter()

    from vllm import LLM, SamplingParams

    speculative_config = None
    if args.drafter:
        speculative_config = {"method": args.method, "model": str(Path(args.drafter).resolve()),
                              "num_speculative_tokens": args.num_speculative_tokens}
    extra = {"per_request_spec_decode_metrics": "summary"} if args.drafter else {}
    llm = LLM(model=str(Path(args.target).resolve()), dtype=args.dtype, speculative_config=speculative_config,
              disable_log_stats=False, gpu_memory_utilization=0.3, enforce_eager=True,
              max_model_len=args.max_model_len, max_num_seqs=max(4, args.concurrency), seed=0, **extra)
    load_seconds = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()
    conversations, groups = load_messages(args.prompts, args.limit, args.by)
    if not conversations:
        print(f"no prompts in {args.prompts}", file=sys.stderr)
        return 2
    prompt_ids = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    def params(request: int):
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens,
                              seed=args.seed + request if args.temperature > 0 and args.seed >= 0 else None)

    def generate(batch: list[tuple[int, list[int]]]):
        return llm.generate([{"prompt_token_ids": ids} for _, ids in batch], [params(i) for i, _ in batch],
                            use_tqdm=False)

    if not args.no_warmup:
        generate([(0, prompt_ids[0])] * min(args.concurrency, 4))
    requests = [(index * args.samples + sample, index) for index in range(len(prompt_ids))
                for sample in range(args.samples)]
    before = spec_metrics(llm)
    answers = []
    total_seconds = 0.0
    for start in range(0, len(requests), args.concurrency):
        wave = requests[start:start + args.concurrency]
        t0 = time.perf_counter()
        outputs = generate([(request, prompt_ids[index]) for request, index in wave])
        seconds = time.perf_counter() - t0
        total_seconds += seconds
        for (request, index), output in zip(wave, outputs):
            completion = output.outputs[0]
            stats = getattr(output, "metrics", None)
            latency = (stats.last_token_ts - stats.queued_ts
                       if stats is not None and stats.last_token_ts and stats.queued_ts else seconds)
            spec = getattr(completion, "spec_decode_metrics", None)
            answers.append({"index": index, "request": request, "group": groups[index],
                            "prompt_tokens": len(prompt_ids[index]), "output_token_ids": list(completion.token_ids),
                            "seconds": seconds, "latency": latency, "finish_reason": completion.finish_reason,
                            "spec": None if spec is None else {"histogram": list(spec.histogram),
                                                               "num_draft_tokens": spec.num_draft_tokens}})
    counters = difference(spec_metrics(llm), before)
    output_tokens = sum(len(a["output_token_ids"]) for a in answers)

    report = {
        "engine": "vllm", "vllm_version": __import__("vllm").__version__,
        "target": str(args.target), "drafter": args.drafter, "method": args.method if args.drafter else None,
        "num_speculative_tokens": args.num_speculative_tokens if args.drafter else 0,
        "dtype": args.dtype, "num_prompts": len(prompt_ids), "num_requests": len(answers),
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "samples": args.samples, "concurrency": args.concurrency, "by": args.by,
        "load_seconds": load_seconds, "seconds": total_seconds, "output_tokens": output_tokens,
        "tokens_per_second": output_tokens / total_seconds if total_seconds > 0 else 0.0,
        "spec_metrics": counters, "answers": answers,
    }
    latencies = sorted(a["latency"] for a in answers)
    report["latency_seconds"] = {"median": percentile(latencies, 50), "p90": percentile(latencies, 90)}
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    if drafts:
        report["acceptance_length"] = 1.0 + counters.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts
        report["per_position_acceptance"] = [a / drafts for a in counters.get(SPEC_VECTOR, [])]
        draft_tokens = counters.get("vllm:spec_decode_num_draft_tokens", 0)
        report["draft_acceptance_rate"] = (counters.get("vllm:spec_decode_num_accepted_tokens", 0) / draft_tokens
                                           if draft_tokens else None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    summary = (f"vllm {args.dtype} {'plain' if not args.drafter else args.method}: {len(answers)} requests, "
               f"{output_tokens} tokens in {total_seconds:.1f}s = {report['tokens_per_second']:.1f} tokens/s "
               f"(load {load_seconds:.0f}s)")
    if drafts:
        summary += f", acceptance length {report['acceptance_length']:.3f} over {drafts} drafts"
    print(summary, flush=True)
    return 0


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    sys.exit(main())
