"""The model families the project claims, as tiny random configs (2 layers, width 64): one table shared by the
architecture sweep (tests/test_architectures.py) and the per-family unit checks. docs/models.md lists them."""
from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

LLAMA_LIKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=512)
MOE = dict(num_experts_per_tok=2)
SLIDING = dict(sliding_window=16)  # shorter than the conversations, so the window applies
# family: (model_type, config overrides, chat template or None for a base model)
FAMILIES = {
    "llama": ("llama", LLAMA_LIKE, "chatml_generation"),
    "mistral": ("mistral", {**LLAMA_LIKE, **SLIDING}, "chatml"),
    "qwen2": ("qwen2", {**LLAMA_LIKE, "use_sliding_window": True, "max_window_layers": 1, **SLIDING}, "chatml"),
    "qwen3": ("qwen3", {**LLAMA_LIKE, "head_dim": 16}, "chatml_generation"),
    "qwen3_moe": ("qwen3_moe", {**LLAMA_LIKE, **MOE, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32},
                  "chatml"),
    "mixtral": ("mixtral", {**LLAMA_LIKE, **MOE, "num_local_experts": 4}, "zephyr"),
    "gemma2": ("gemma2", {**LLAMA_LIKE, **SLIDING, "head_dim": 16,
                          "layer_types": ["sliding_attention", "full_attention"]}, "chatml"),
    "gemma3": ("gemma3_text", {**LLAMA_LIKE, **SLIDING, "head_dim": 16,
                               "layer_types": ["sliding_attention", "full_attention"]}, "chatml"),
    "phi3": ("phi3", {**LLAMA_LIKE, "sliding_window": None}, "zephyr"),
    "olmo2": ("olmo2", LLAMA_LIKE, "chatml"),
    "stablelm": ("stablelm", LLAMA_LIKE, "chatml"),
    "granite": ("granite", LLAMA_LIKE, "chatml"),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512), None),
    "gpt_neox": ("gpt_neox", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=512), None),
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                              new_decoder_architecture=True, max_position_embeddings=512), None),
}


def family_model(family: str, vocab_size: int, **token_ids: int) -> PreTrainedModel:
    """A tiny random causal LM of `family` (untied head, eval mode); `token_ids`: bos/eos/pad_token_id."""
    model_type, overrides, _ = FAMILIES[family]
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, tie_word_embeddings=False,
                                  **token_ids, **overrides)
    return AutoModelForCausalLM.from_config(config).eval()
