"""Start a drafter's block from one of the target's own decoder layers (`train --init-from-target`).

Why: the block has the shape of one target decoder layer (same width, heads, KV heads, MLP), and the target's
last layer already turns a deep residual state into the state its LM head reads. Starting there instead of
from noise gives a short training run a block that already speaks the target's geometry: its attention reads
states the way the target does, its MLP writes in the final layer's basis, and the output norm is the
target's final norm, which is exactly what the LM head expects in front of it. Measured in
docs/benchmarks.md ("The engine form's levers").

The trainer still never runs the target: it reads these few tensors from the model's safetensors files by
name, memory-mapped, and nothing else. Only Llama-layout names are mapped (Llama, Mistral, Qwen2/3, SmolLM,
Gemma share them); any other layout is refused in one line naming the tensor it lacks.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from beagle.target_model import weights_sha256

log = logging.getLogger(__name__)

# drafter parameter -> the target tensor it starts from ("{layer}" is the decoder layer's prefix)
_LAYER_MAP = {
    "q_proj.weight": "{layer}.self_attn.q_proj.weight",
    "k_proj.weight": "{layer}.self_attn.k_proj.weight",
    "v_proj.weight": "{layer}.self_attn.v_proj.weight",
    "o_proj.weight": "{layer}.self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "{layer}.mlp.gate_proj.weight",
    "mlp.up_proj.weight": "{layer}.mlp.up_proj.weight",
    "mlp.down_proj.weight": "{layer}.mlp.down_proj.weight",
    "input_norm.weight": "{layer}.input_layernorm.weight",         # queries (embeddings)
    "kv_norm.weight": "{layer}.input_layernorm.weight",            # key/value states: what the layer reads
    "post_attention_norm.weight": "{layer}.post_attention_layernorm.weight",
    "output_norm.weight": "{model}.norm.weight",                   # before the LM head: the target's final norm
}


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index when the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
                         "--init-from-target needs a local Hugging Face model folder with safetensors weights")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _layer_prefix(names: set[str], layer: int) -> tuple[str, str]:
    """('model.layers.N', 'model') for decoder layer `layer` (negative counts from the end)."""
    for model_prefix in ("model", "model.language_model", "language_model.model"):
        head = model_prefix + ".layers."
        indices = {int(part) for part in (n[len(head):].split(".")[0] for n in names if n.startswith(head))
                   if part.isdigit()}
        if indices:
            count = max(indices) + 1
            chosen = layer if layer >= 0 else count + layer
            if not 0 <= chosen < count:
                raise ValueError(f"--init-layer {layer}: the target has decoder layers 0..{count - 1}")
            return f"{head}{chosen}", model_prefix
    raise ValueError("the target's weights have no '<model>.layers.N' tensors; --init-from-target reads "
                     "Llama-layout decoder layers only")


def target_layer_tensors(model_dir: str | Path, drafter: nn.Module, layer: int = -1) -> dict[str, torch.Tensor]:
    """The drafter's block parameters as the target's decoder layer `layer` holds them (fp32), by drafter name.

    Only the parameters the drafter has are read; a name the target lacks or a shape that differs is refused in
    one line (the block was sized from the same architecture, so a mismatch means a different model)."""
    model_dir = Path(model_dir)
    files = _tensor_files(model_dir)
    layer_prefix, model_prefix = _layer_prefix(set(files), layer)
    own = dict(drafter.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for name, pattern in _LAYER_MAP.items():
        if name not in own:
            continue
        source = pattern.format(layer=layer_prefix, model=model_prefix)
        if source not in files:
            raise ValueError(f"{model_dir}: no tensor {source!r} for the drafter's {name}; "
                             "--init-from-target reads Llama-layout decoder layers only")
        with safe_open(str(files[source]), framework="pt") as f:
            value = f.get_tensor(source).float()
        if value.shape != own[name].shape:
            raise ValueError(f"{model_dir}: {source} has shape {list(value.shape)}, the drafter's {name} "
                             f"{list(own[name].shape)}; is this the store's target?")
        tensors[name] = value
    return tensors


def refuse_other_target(model_dir: str | Path, store_target: dict) -> None:
    """One line when `model_dir` is not the target the store was extracted from (its manifest's weights hash;
    one streamed read of the weights). A store without the hash (an old one) is taken at its word."""
    expected = (store_target or {}).get("weights_sha256")
    if expected and weights_sha256(model_dir) != expected:
        raise ValueError(f"--init-from-target {model_dir}: its weights are not the ones the store was extracted "
                         f"from (store target {store_target.get('name')!r}); pass that target's folder")


@torch.no_grad()
def init_from_target(drafter: nn.Module, model_dir: str | Path, layer: int = -1,
                     store_target: dict | None = None) -> list[str]:
    """Copy the target's decoder layer `layer` into the drafter's block, in place; returns the names set.
    With `store_target` (a store manifest's `target`), a folder holding other weights is refused first."""
    if store_target is not None:
        refuse_other_target(model_dir, store_target)
    tensors = target_layer_tensors(model_dir, drafter, layer)
    own = dict(drafter.named_parameters())
    for name, value in tensors.items():
        own[name].copy_(value.to(own[name].dtype))
    log.info("drafter block initialised from %s decoder layer %d (%d tensors)", model_dir, layer, len(tensors))
    return sorted(tensors)
