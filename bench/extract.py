"""Benchmark extraction (not a test): extraction tokens/s / bare target forward tokens/s, one run.

Both sides run the same model, dtype, thread count and the same batches (each shard's token-budget
plan). "Extraction" is what `beagle-pipeline extract` sustains inside its forward actor: the forward
plus copying the states out, writing and checksumming the shard, i.e. tokens / actor busy time. The
end-to-end rate (including Ray start, tokenization and the actor loading the model) is printed too.
"Bare" is `model.model(input_ids, attention_mask)` over the same batches and nothing else.

    python bench/extract.py [--model DIR --data FILE] [--conversations 300] [--dtype bfloat16]

Without --model a random Llama (d=512, 8 layers, 8 heads / 4 KV heads) and synthetic ShareGPT-style
conversations are built in a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.tiny


def build_bench_target(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import build_tokenizer
    tokenizer = build_tokenizer(directory, template="chatml")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=1536, vocab_size=len(tokenizer), max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def synthetic_conversations(path: Path, count: int) -> Path:
    words = ("the quick brown fox jumps over a lazy dog while the capital of France is Paris and "
             "numbers like 42 or 1999 appear in short poems about the sea").split()
    rng = random.Random(0)
    with open(path, "w") as handle:
        for i in range(count):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"from": "human", "value": " ".join(rng.choices(words, k=rng.randint(10, 60)))})
                turns.append({"from": "gpt", "value": " ".join(rng.choices(words, k=rng.randint(30, 200)))})
            handle.write(json.dumps({"id": f"b{i}", "conversations": turns}) + "\n")
    return path


def bare_forward_tokens_per_second(model_path: str, store_url: str, *, dtype: str, batch_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    from pipeline.extract.forward import DTYPES, plan_batches
    from pipeline.store import open_store

    store = open_store(store_url)
    shards, start = [], 0
    for shard in store.manifest["shards"]:
        shards.append([store[i]["input_ids"] for i in range(start, start + shard["samples"])])
        start += shard["samples"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype], local_files_only=True).eval()
    base = getattr(model, model.base_model_prefix)
    tokens, seconds = 0, 0.0
    with torch.inference_mode():
        for sequences in shards:
            for batch in plan_batches([len(s) for s in sequences], batch_tokens):
                rows = [sequences[i] for i in batch]
                longest = max(len(r) for r in rows)
                input_ids = torch.zeros(len(rows), longest, dtype=torch.long)  # [B, L]
                attention_mask = torch.zeros(len(rows), longest, dtype=torch.long)  # [B, L]
                for k, row in enumerate(rows):
                    input_ids[k, :len(row)] = row
                    attention_mask[k, :len(row)] = 1
                started = time.perf_counter()
                base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                seconds += time.perf_counter() - started
                tokens += sum(len(r) for r in rows)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--data")
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--samples-per-shard", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from pipeline.extract.pipeline import ExtractConfig, run_extract

    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        root = Path(tmp)
        model = args.model or str(build_bench_target(root / "target"))
        data = args.data or str(synthetic_conversations(root / "chats.jsonl", args.conversations))
        config = ExtractConfig(model_path=model, data=(data,), out=str(root / "store"), dtype=args.dtype,
                               max_length=args.max_length, batch_tokens=args.batch_tokens,
                               samples_per_shard=args.samples_per_shard, num_workers=1)
        summary = run_extract(config)
        extraction = summary.forward_tokens / summary.actor_seconds
        bare = bare_forward_tokens_per_second(model, str(root / "store"), dtype=args.dtype,
                                              batch_tokens=args.batch_tokens)
        print("\n".join(summary.lines()))
        print(f"threads {torch.get_num_threads()}, {args.dtype}, {summary.samples} samples, "
              f"{summary.tokens:,} tokens, {summary.shards} shards")
        print(f"bare forward             {bare:10,.0f} tokens/s")
        print(f"extraction (actor busy)  {extraction:10,.0f} tokens/s  "
              f"(forward alone {summary.forward_tokens / summary.actor_forward_seconds:,.0f} tokens/s)")
        print(f"extraction (end to end)  {summary.tokens_per_second:10,.0f} tokens/s  "
              f"(incl. actor start; {summary.forward_seconds:.1f}s wall)")
        print(f"ratio extraction / bare  {extraction / bare:10.3f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
