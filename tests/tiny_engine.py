"""A tiny target that a real serving engine runs and a drafter can learn, and a store of its own answers.

Built in seconds, nothing downloaded:

* The target is a Llama with head_dim 64 (hidden 128, 2 heads, 1 KV head, 2 layers, max positions 2048):
  vLLM 0.32's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512 only
  (`CPUAttentionBackend.get_supported_head_sizes`), not the 16 of the other tiny test models, and
  bench/serve_vllm.py asks for max_model_len 2048. It is *trained* here, ~10 s, on a tiny language (the
  sentences below, always in the same cyclic order; the answer to a sentence starts at the next one), with
  tests/tiny.py's byte-level BPE tokenizer and a ChatML template. A random-weight target (even a peaky one,
  initializer_range 0.1) is chaotic: its greedy answers to new prompts are noise that a one-layer drafter
  does not learn in a few hundred steps (measured: τ 1.03 on unseen prompts after 540 steps, 1.7 on the
  prompts it was trained on, depth 3 almost never accepted), while on the trained target's language the
  drafter gets τ ~2.5 on held-out prompts, with tokens accepted at every depth.
* The store holds the target's own greedy answers (self-distillation) as token ids, with the hidden
  states the target computes over them (`output_hidden_states=True`, HF indices as `extract --layers`
  captures them), the loss on the answer. Token ids are kept as generated: decoding an answer to text and
  tokenizing it again may merge BPE pieces the target emitted one by one, and the drafter would then
  learn sequences the target never produces.
"""
from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from beagle.decoding.generate import plain_generate
from beagle.prompts import render
from pipeline.extract.chat import tokenizer_fingerprint
from pipeline.jobkit.target import target_fingerprint
from pipeline.extract.state_encoding import write_store
from tests.tiny import VOCAB_SIZE, build_tokenizer

# max_position_embeddings: bench/serve_vllm.py asks vLLM for max_model_len 2048, which must fit.
ENGINE_ARCH = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   intermediate_size=256, num_hidden_layers=2, max_position_embeddings=2048)
SENTENCES = ("The quick brown fox jumps over the lazy dog.", "Hello, how are you today?", "I am fine, thank you.",
             "What is the capital of France?", "The capital of France is Paris.",
             "Write a short poem about the sea.", "Sure! Here is a list: 1, 2, 3.",
             "Numbers 0123456789 and symbols {}[]()<>.")
WORDS = " ".join(SENTENCES).replace(".", "").replace("?", "").replace(",", "").replace("!", "").split()


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside: results independent of the machine's core count, and on a shared 2-core
    machine 1.5-30x faster for these tiny shapes than two threads fighting other jobs (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _answer(start: int, tokenizer, length: int) -> list[int]:
    text = " ".join(SENTENCES[(start + j) % len(SENTENCES)] for j in range(2 * len(SENTENCES)))
    return tokenizer(text, add_special_tokens=False)["input_ids"][:length]


def build_engine_target(directory: str | Path, *, seed: int = 0, steps: int = 100, batch: int = 8,
                        lr: float = 3e-3, answer_tokens: int = 200, **overrides):
    """Train the tiny target on its language (100 AdamW steps, ~10 s) and save it with its tokenizer in
    `directory` (fp32 safetensors); returns (model, tokenizer, last training loss). Deterministic in `seed`:
    it trains on one torch thread."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory, template="chatml")
    torch.manual_seed(seed)
    config = LlamaConfig(**{**ENGINE_ARCH, **overrides}, vocab_size=max(VOCAB_SIZE, len(tokenizer)),
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    data = [(render(tokenizer, [{"role": "user", "content": sentence}]), _answer(k + 1, tokenizer, answer_tokens))
            for k, sentence in enumerate(SENTENCES)]
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with one_thread():
        model.train()
        for _ in range(steps):
            rows = [data[rng.randrange(len(data))] for _ in range(batch)]
            width = max(len(p) + len(a) for p, a in rows)
            ids = torch.full((batch, width), tokenizer.pad_token_id)
            labels = torch.full((batch, width), -100)
            for i, (prompt, answer) in enumerate(rows):
                ids[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
                labels[i, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    model.save_pretrained(str(directory))
    return model, tokenizer, loss.item()


def word_questions(n: int, seed: int) -> list[str]:
    """`n` distinct questions made of a few of the language's words, in no sentence's order (deterministic in
    `seed`): the target never saw them, and answers them in its language all the same."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) + "?"
        if question not in out:
            out.append(question)
    return out


def write_prompts(path: str | Path, texts: list[str]) -> Path:
    """An MT-Bench-style question.jsonl: one {"question_id", "turns": [text]} per line (first turns only)."""
    path = Path(path)
    path.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(texts)),
                    encoding="utf-8")
    return path


def greedy_answers(model, tokenizer, texts: list[str], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per question, the prompt rendered as eval and vLLM render it."""
    eos = {tokenizer.eos_token_id}
    out = []
    with torch.no_grad():
        for text in texts:
            prompt = render(tokenizer, [{"role": "user", "content": text}])
            out.append((prompt, plain_generate(model, torch.tensor(prompt), max_new_tokens, eos).tokens))
    return out


def min_top2_gap(model, prompt: list[int], answer: list[int]) -> float:
    """The smallest top-1 minus top-2 logit over the steps that chose `answer`. Far above the fp32 rounding
    differences between two engines' kernels, every engine chooses the same tokens."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def write_answer_store(path: str | Path, target_dir: str | Path, model, tokenizer,
                       conversations: list[tuple[list[int], list[int]]], *, layers: tuple[int, ...]) -> str:
    """A feature store of (prompt + answer) sequences with the target's hidden states at `layers` (HF
    hidden_states indices, -1 = after the final norm); the loss mask covers the answer. The manifest's
    target and tokenizer facts are extract's own (so `export --target` recognises the target)."""
    samples = []
    with torch.no_grad():
        for i, (prompt, answer) in enumerate(conversations):
            ids = torch.tensor(prompt + answer)
            out = model(input_ids=ids[None], output_hidden_states=True)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt):] = True
            samples.append({"sample_id": f"a{i}", "input_ids": ids, "loss_mask": mask,
                            "hidden_states": torch.stack([out.hidden_states[layer][0] for layer in layers])})
    write_store(str(path), samples,
                head={"embed_tokens": model.get_input_embeddings().weight.detach().clone(),
                      "lm_head": model.get_output_embeddings().weight.detach().clone()},
                target=target_fingerprint(str(target_dir), "float32"),
                tokenizer=tokenizer_fingerprint(str(target_dir), tokenizer),
                capture={"layers": list(layers), "dtype": "float32",
                         "max_length": max(len(p) + len(a) for p, a in conversations)},
                source={"name": "greedy-self-answers", "num_samples": len(samples)})
    return str(path)
