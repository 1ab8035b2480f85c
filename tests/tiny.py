"""Tiny real targets for tests: a random LlamaForCausalLM and a byte-level BPE tokenizer built on the spot.

Nothing is downloaded. The tokenizer is trained in milliseconds on a fixed text, so ids are stable
across runs; the model weights come from a fixed seed. Three chat templates cover the loss-mask paths:
ChatML with `{% generation %}` markers, the same ChatML without them, and a Zephyr-like template that
inserts a default system prompt (as SmolLM2's does) and ends turns with the eos token.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>' + '\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CHATML = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
ZEPHYR = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|system|>\nYou are a helpful assistant.</s>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '</s>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"
)
TEMPLATES = {"chatml_generation": CHATML_GENERATION, "chatml": CHATML, "zephyr": ZEPHYR}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "</s>",
                  "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 320

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you.\n"
    "What is the capital of France? The capital of France is Paris. Write a short poem about the sea.\n"
    "user assistant system: Sure! Here is a list: 1, 2, 3. Numbers 0123456789 and symbols {}[]()<>.\n"
) * 4


def build_tokenizer(directory: str | Path, *, template: str | None = "chatml_generation") -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (any text encodes, offsets are exact) and save it with `template` (None: a base
    model's tokenizer, without a chat template, ending texts with <|endoftext|>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([_CORPUS], trainer=trainer)
    eos = "<|endoftext|>" if template is None else "<|im_end|>" if template.startswith("chatml") else "</s>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=eos,
                                   bos_token="<|endoftext|>", unk_token=None)
    if template is not None:
        fast.chat_template = TEMPLATES.get(template, template)
    fast.save_pretrained(str(directory))
    return fast


def tiny_config(vocab_size: int = VOCAB_SIZE, *, tied: bool = False) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=512,
                       tie_word_embeddings=tied)


def build_model(directory: str | Path, *, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                tied: bool = False) -> LlamaForCausalLM:
    """A random tiny Llama in fp32, saved as safetensors (`tied`: LM head shares the embedding)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(vocab_size, tied=tied)).eval()
    model.save_pretrained(str(directory))
    return model


def build_target(directory: str | Path, *, template: str | None = "chatml_generation", seed: int = 0,
                 tied: bool = False) -> Path:
    """A complete local target (model + tokenizer) in `directory`; returns the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory, template=template)
    build_model(directory, seed=seed, vocab_size=max(VOCAB_SIZE, len(tokenizer)), tied=tied)
    return directory
