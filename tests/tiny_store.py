"""Build tiny real feature stores for trainer tests: a random LlamaForCausalLM from a config (no
download) run with output_hidden_states=True on token sequences, written with pipeline.store."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.extract.state_encoding import write_store

TINY_ARCH = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=300, max_position_embeddings=256,
                 initializer_range=0.1)  # peakier target distributions than the 0.02 default


def tiny_target(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_ARCH, **overrides}, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def _architecture(config: LlamaConfig) -> dict:
    rope = getattr(config, "rope_theta", None)
    if rope is None:
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return {
        "hidden_size": config.hidden_size, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "rope_theta": float(rope), "rms_norm_eps": config.rms_norm_eps,
        "num_hidden_layers": config.num_hidden_layers,
        "max_position_embeddings": config.max_position_embeddings,
    }


def _sequences(n: int, vocab: int, seed: int, min_len: int, max_len: int) -> list[torch.Tensor]:
    """Token sequences with learnable structure: a random walk t_{i+1} = t_i + small step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        steps = torch.randint(1, 4, (L,), generator=g)
        start = torch.randint(0, vocab, (1,), generator=g)
        out.append((start + steps.cumsum(0)) % vocab)
    return out


def build_tiny_store(path: str | Path, *, num_samples: int = 24, min_len: int = 12, max_len: int = 40,
                     seed: int = 0, model_seed: int = 0, dtype: str = "float32",
                     model: LlamaForCausalLM | None = None, layers: tuple[int, ...] = (-1,),
                     model_dir: str | Path | None = None, nan_sample: int | None = None,
                     **arch_overrides) -> str:
    """Write a store of `num_samples` sequences; loss_mask covers the second half of each sequence
    (the "assistant" part); `layers` are HF hidden_states indices (-1 = after the final norm), as
    `extract --layers` captures them. With `model_dir`, the target is saved there and the manifest records
    its weight files' hash, as `extract` does, so commands given `--model model_dir` accept the store.
    `nan_sample`: that sample's states hold one NaN (a target that overflowed). Returns the store path."""
    model = model or tiny_target(model_seed, **arch_overrides)
    cfg = model.config
    samples = []
    with torch.no_grad():
        for i, ids in enumerate(_sequences(num_samples, cfg.vocab_size, seed, min_len, max_len)):
            out = model(input_ids=ids[None], output_hidden_states=True)
            hidden = torch.stack([out.hidden_states[layer][0] for layer in layers])  # [n_layers, L, d]
            if i == nan_sample:
                hidden[:, len(ids) // 2, 0] = float("nan")
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(ids) // 2:] = True
            samples.append({"sample_id": f"s{i}", "input_ids": ids, "loss_mask": mask,
                            "hidden_states": hidden.to(getattr(torch, dtype))})
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    weights_sha256 = hashlib.sha256(weights).hexdigest()
    if model_dir is not None:
        from beagle.target_model import weights_sha256 as files_sha256

        model.save_pretrained(model_dir)
        weights_sha256 = files_sha256(model_dir)
    target = {
        "name": f"tiny-llama-{model_seed}",
        "config_sha256": hashlib.sha256(cfg.to_json_string().encode()).hexdigest(),
        "weights_sha256": weights_sha256,
        "architecture": _architecture(cfg),
    }
    write_store(str(path), samples,
                head={"embed_tokens": model.get_input_embeddings().weight.detach().clone(),
                      "lm_head": model.get_output_embeddings().weight.detach().clone()},
                target=target, tokenizer={"name": "none", "vocab_size": cfg.vocab_size},
                capture={"layers": list(layers), "dtype": dtype, "max_length": max_len},
                source={"name": "random-walk", "seed": seed, "num_samples": num_samples})
    return str(path)
