"""The target's states at a few layers, without keeping all of them.

`output_hidden_states=True` makes a transformers model keep every layer's states until the forward returns:
n+1 tensors of [B, L, d] where the drafter needs one to four (33 x 32k x 4096 bf16 = 8.6 GB for an 8B
target's 32k-token prefill). `LayerCapture` hooks only the layers asked for instead:

- layer j in 0..n-1 (HF `hidden_states[j]`: the embeddings for j = 0) is the input of decoder layer j,
  taken by a forward pre-hook on it;
- layer -1 (= n, after the final norm) is the base model's `last_hidden_state`, taken by a forward hook on
  the base model (the causal-LM wrapper may slice it for `logits_to_keep`, the base model's output is whole).

tests/test_layer_capture.py checks both identities against `output_hidden_states` on every tested family.
A model whose decoder layers cannot be found (no single `ModuleList` of n layers under the base model)
falls back to `output_hidden_states`, correct and as costly as before.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder under a causal-LM wrapper (`model.model`, `model.transformer`, ...), or `model` itself."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return base if isinstance(base, torch.nn.Module) else model


def decoder_layers(base: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList | None:
    """The base model's list of `num_layers` decoder layers, or None when there is not exactly one."""
    lists = [child for child in base.children() if isinstance(child, torch.nn.ModuleList) and len(child) == num_layers]
    return lists[0] if len(lists) == 1 else None


def eagle3_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three aux layers, low, middle and high: (2, n // 2, n - 3), the layers vLLM's and SGLang's
    EAGLE-3 drafters read by default and speculators' and SpecForge's data generation capture. Both engines
    number them as HF `hidden_states` indices (the residual stream entering decoder layer i), as we do.
    Below 7 layers that recipe repeats a layer; there (1, n // 2, n - 1) keeps three distinct ones while
    n >= 4, and shallower test models get what is left, clamped to 0..n-1 and deduplicated."""
    recipe = (2, num_layers // 2, num_layers - 3) if num_layers >= 7 else (1, num_layers // 2, num_layers - 1)
    return sorted({min(max(layer, 0), num_layers - 1) for layer in recipe})


def default_capture_layers(num_layers: int) -> list[int]:
    """What `extract` stores when `--layers` is not given: EAGLE-3's aux layers, which key the engine form
    (`train --residual state`) and every EAGLE-3 export, plus -1, the state the LM head reads, which the
    paper form keys on and every form's loss targets. One store then trains every form we ship (each form's
    row of beagle/registry.py says what it keys on)."""
    from beagle.registry import capture_layers

    return capture_layers(None, num_layers)


def normalize_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """Check `--layers` against the model and make them canonical: -1, or 0..n-1 (n is the same as -1)."""
    canonical = []
    for layer in layers:
        if not -(num_layers + 1) <= layer <= num_layers:
            raise ValueError(f"--layers {layer}: out of range for a model with {num_layers} layers; use -1 "
                             f"(after the final norm) or 0..{num_layers - 1} (0 = embeddings)")
        value = layer + num_layers + 1 if layer < 0 else layer
        canonical.append(-1 if value == num_layers else value)
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"--layers {list(layers)}: names the same layer twice (canonical {canonical})")
    return canonical


class LayerCapture:
    """Hooks that keep the states of `layers` (HF `hidden_states` indices, -1 = after the final norm) during
    the forwards run inside `with`:

        with LayerCapture(model, (2, -1)) as capture:
            outputs = model(..., output_hidden_states=capture.output_hidden_states)
        states = capture.states(outputs)  # [[B, L, d] for layer 2, [B, L, d] for layer -1]

    `model` is a causal LM or its base model; the capture holds the last forward's states only."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int]) -> None:
        self.base = base_model(model)
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
        self.layers = tuple(layers)
        n = self.num_layers
        self.wanted = [n if layer == -1 else layer for layer in normalize_layers(layers, n)]  # 0..n, n = final
        stack = decoder_layers(self.base, self.num_layers) if self.num_layers else None
        needs_stack = any(layer < self.num_layers for layer in self.wanted)
        self.stack = stack
        # without the layer list, fall back to every layer's states (correct, as costly as before)
        self.output_hidden_states = needs_stack and stack is None
        if self.output_hidden_states:
            log.info("%s: decoder layers not found; capturing layers %s through output_hidden_states",
                     type(self.base).__name__, list(self.layers))
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "LayerCapture":
        self._captured.clear()
        if self.output_hidden_states:
            return self
        if self.stack is not None:
            for index in sorted({layer for layer in self.wanted if layer < self.num_layers}):
                self._handles.append(self.stack[index].register_forward_pre_hook(
                    self._keep_input(index), with_kwargs=True))
        if self.num_layers in self.wanted:
            self._handles.append(self.base.register_forward_hook(self._keep_last))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep_input(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._captured[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _keep_last(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        last = getattr(output, "last_hidden_state", None)
        self._captured[self.num_layers] = last if last is not None else output[0]

    def states(self, outputs: Any = None) -> list[torch.Tensor]:
        """The wanted layers' states `[B, L, d]` each, in the order asked; `outputs` (the forward's return) is
        read only in the fallback, where it holds `hidden_states`."""
        if self.output_hidden_states:
            return [outputs.hidden_states[layer] for layer in self.wanted]
        return [self._captured[layer] for layer in self.wanted]
