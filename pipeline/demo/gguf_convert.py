"""Turning a GGUF checkpoint into a plain transformers checkpoint (safetensors + tokenizer).

transformers reads GGUF (`gguf_file=`) but a model loaded that way carries the GGUF loading state and
cannot be `save_pretrained`; its `from_pretrained` path also wants `accelerate`. We do the same in three
plain steps with transformers' own GGUF readers: the config from the GGUF metadata (no quantization
entry), a fresh model of that class in the target dtype, and the dequantized tensors loaded into it
strictly. The result is an ordinary checkpoint that every part of the pipeline loads with
`from_pretrained(dir)`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertedCheckpoint:
    """What `convert_gguf` wrote, for the prep manifest."""

    out_dir: Path
    architecture: str
    num_parameters: int
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    dtype: str
    has_chat_template: bool


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16
                 ) -> ConvertedCheckpoint:
    """Write `out_dir` = config.json + model.safetensors (in `dtype`) + tokenizer files, from one GGUF file.

    Raises ValueError when the GGUF has tensors the rebuilt model does not expect, or lacks some it needs
    (other than an LM head tied to the embedding).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    folder, name = str(gguf_path.parent), gguf_path.name

    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved checkpoint holds dequantized weights
    logger.info("GGUF config: %s, d=%d, %d layers, vocab %d", config.model_type, config.hidden_size,
                config.num_hidden_layers, config.vocab_size)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    _load_strict(model, tensors, gguf_path)
    model.eval()

    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.dtype = dtype
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return ConvertedCheckpoint(
        out_dir=out_dir, architecture=type(model).__name__,
        num_parameters=sum(p.numel() for p in model.parameters()),
        hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size, dtype=str(dtype).removeprefix("torch."),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)))


def _load_strict(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Copy `tensors` into `model` (casting to its dtype); every parameter must be covered."""
    expected = set(model.state_dict())
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ValueError(f"{source}: tensors {unexpected[:5]} have no place in {type(model).__name__}")
    missing = expected - set(tensors)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        missing.discard("lm_head.weight")  # the GGUF stores a tied head once, as the embedding
    if missing:
        raise ValueError(f"{source}: no tensors for {sorted(missing)[:5]} of {type(model).__name__}")
    with torch.no_grad():
        state = model.state_dict()
        for name, tensor in tensors.items():
            if state[name].shape != tensor.shape:
                raise ValueError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model "
                                 f"expects {tuple(state[name].shape)}")
            state[name].copy_(tensor)
    if tied:
        model.tie_weights()
