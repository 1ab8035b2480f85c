"""Tiny real targets, drafters with deliberately set weights, and a local chat tokenizer for decoding tests.

Acceptance is forced by construction, not by mocking: with `context_scale=0` the target's attention and
MLP outputs are zeroed, so it is a bigram model whose next token is argmax LMHead(norm(Emb(t))). A drafter
whose attention output and MLP are zeroed computes ĥ = Emb(t), and RMSNorm only rescales a vector by a
positive number, so its argmax is the target's (always accepts) or, with the LM head negated, the
target's argmin (never accepts). A small positive `context_scale` brings the context back in a little:
the drafter then agrees only sometimes, and the target's KV cache matters.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from beagle.model import BeagleDrafter, DrafterConfig


def tiny_target(vocab_size: int = 64, seed: int = 0, context_scale: float = 1.0, layers: int = 2,
                attn_implementation: str = "sdpa", hidden_size: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                         attn_implementation=attn_implementation)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.2)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(context_scale)
            layer.mlp.down_proj.weight.mul_(context_scale)
    return model


def _head(target: LlamaForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    return target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()


def random_drafter(target: LlamaForCausalLM, seed: int = 1, std: float = 0.2) -> BeagleDrafter:
    """A drafter with random weights: it agrees with the target only by chance."""
    torch.manual_seed(seed)
    embed, head = _head(target)
    drafter = BeagleDrafter(DrafterConfig.from_architecture(target.config.to_dict()), embed, head)
    drafter.reset_parameters(std=std)
    return drafter.eval()


def bigram_drafter(target: LlamaForCausalLM, agree: bool = True, seed: int = 1) -> BeagleDrafter:
    """ĥ = Emb(t): predicts the bigram target's token (agree) or its least likely one (disagree)."""
    embed, head = _head(target)
    drafter = BeagleDrafter(DrafterConfig.from_architecture(target.config.to_dict()), embed,
                            head if agree else -head)
    torch.manual_seed(seed)
    drafter.reset_parameters(std=0.2)
    with torch.no_grad():
        drafter.o_proj.weight.zero_()
        drafter.mlp.down_proj.weight.zero_()
    return drafter.eval()


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_tokenizer_dir(directory: Path, words: int = 40):
    """Save a word-level tokenizer with a chat template; its vocabulary has `words + 6` entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<eos>"]
    vocab = {token: index for index, token in enumerate(specials + [f"w{i}" for i in range(words)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
