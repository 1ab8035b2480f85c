"""Sliding-window and hybrid targets: speculative decoding equals plain decoding, and plain decoding equals
transformers' own `generate` with its rolling sliding-window cache (so the window really applies).

The window is made short (6) and the generation long (40 tokens), so that most positions are beyond it and
rejected drafts have to be cut out of caches that hold more than a window.
"""
from __future__ import annotations

import pytest
import torch

from beagle.decoding import DraftConfig
from beagle.decoding.generate import plain_generate, speculative_generate
from beagle.decoding.verify import check_supported
from beagle.prompts import render
from tests.decoding_helpers import bigram_drafter

WINDOW = 6
NEW_TOKENS = 40
SIZES = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _mistral(window):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=window, **SIZES))


def _qwen2(window):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, use_sliding_window=window is not None,
                                        sliding_window=window, max_window_layers=1, **SIZES))


def _gemma2(window):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    kinds = ["sliding_attention", "full_attention"] if window else ["full_attention"] * 2
    return Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, head_dim=8, tie_word_embeddings=False, sliding_window=window or 4096,
                                          layer_types=kinds, **SIZES))


def _gemma3(window):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["sliding_attention", "sliding_attention", "full_attention"] if window else ["full_attention"] * 3
    return Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=3, head_dim=8, tie_word_embeddings=False, sliding_window=window or 4096,
                                              layer_types=kinds, **SIZES))


FAMILIES = {"mistral": _mistral, "qwen2": _qwen2, "gemma2": _gemma2, "gemma3": _gemma3}


def _target(family: str, window: int | None, seed: int = 0) -> torch.nn.Module:
    """A tiny random target whose context matters (attention and MLP weights larger than the embeddings; Gemma's
    head untied, or its scaled embedding makes it repeat the last token)."""
    torch.manual_seed(seed)
    model = FAMILIES[family](window).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.5)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_speculative_decoding_equals_plain_decoding_beyond_the_window(family):
    target = _target(family, WINDOW)
    check_supported(target)
    prompt = torch.tensor([3, 5, 7, 9, 11, 2, 4, 6, 8, 10])  # longer than the window already
    plain = plain_generate(target, prompt, NEW_TOKENS, set()).tokens
    with torch.no_grad():  # transformers' own decoding, with its rolling sliding-window cache
        reference = target.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    assert plain == reference[0, len(prompt):].tolist()
    assert len(set(plain)) >= 5  # not a degenerate repetition
    unwindowed = _target(family, None)
    unwindowed.load_state_dict(target.state_dict())
    assert plain_generate(unwindowed, prompt, NEW_TOKENS, set()).tokens != plain  # the window changes the output
    drafter = bigram_drafter(target)
    accepted = 0
    for config in (DraftConfig.chain(depth=3), DraftConfig(depth=4, top_k=3, total_tokens=10)):
        result = speculative_generate(target, drafter, prompt, NEW_TOKENS, set(), config)
        assert result.tokens == plain, config
        accepted += sum(result.accepted)
    assert accepted > 0  # rejections and acceptances both happened: the caches were cut back


def test_a_target_with_linear_attention_layers_is_refused_up_front():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(num_hidden_layers=4, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=16, **SIZES)
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM has linear_attention layers.*cannot be removed"):
        check_supported(Qwen3NextForCausalLM(config))


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_regenerate_answers_a_sliding_window_target_as_its_own_greedy_decoding(family, tmp_path):
    """`regenerate`'s batched, left-padded generation (the code its Ray actors run) on a sliding-window target
    gives each conversation the answer plain greedy decoding gives it alone, beyond the window."""
    from pipeline.regenerate.generation import ConversationGenerator, GenerateConfig
    from pipeline.regenerate.prompts import PromptRecord
    from tests.tiny import build_tokenizer

    tokenizer = build_tokenizer(tmp_path, template="chatml")
    small = _target(family, WINDOW)  # the family's config, made at the tokenizer's vocabulary
    config = small.config.__class__(**{**small.config.to_dict(), "vocab_size": len(tokenizer),
                                       "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    model = small.__class__(config).eval()
    model.save_pretrained(str(tmp_path))
    generator = ConversationGenerator(GenerateConfig(model_path=str(tmp_path), dtype="float32", max_new_tokens=20,
                                                     batch_size=3))
    records = [PromptRecord(f"r{i}", "test", i, (), (text,)) for i, text in
               enumerate(["Hello", "What is the capital of France? The quick brown fox", "Write a poem"])]
    answers = generator.answer(records, seed=0)
    for record, answer in zip(records, answers):
        ids = render(tokenizer, [{"role": "user", "content": record.turns[0]}])
        plain = plain_generate(model, torch.tensor(ids), 20, {tokenizer.eos_token_id}).tokens
        plain = plain[:-1] if plain and plain[-1] == tokenizer.eos_token_id else plain
        assert answer.messages[-1]["content"] == tokenizer.decode(plain, skip_special_tokens=True), record.sample_id
    assert len(ids) + 20 > WINDOW
