"""What the target model is, read one way: transformers' own config, never config.json by hand.

Extraction records these facts in the store manifest (`target["architecture"]`), the trainer sizes the
drafter from that record, and evaluation and regeneration check the target they load with the same
reader. Reading through `AutoConfig` means transformers resolves each family's names (GPT-2's `n_layer`,
`n_embd`, `n_head` through the config's `attribute_map`), nested text configs of multimodal models, and
defaults a config.json leaves out, so every part of the project sees the same numbers.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

logger = logging.getLogger(__name__)

# The manifest's architecture keys, in the order (and with the values) every store so far has recorded
# them: a Llama-family target keeps exactly this dict, so its dataset_id is unchanged.
ARCHITECTURE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps", "num_hidden_layers",
                     "max_position_embeddings")
# Facts without which neither a forward nor a drafter can be sized.
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
# Norm epsilon under the names the families use (GPT-2 has a LayerNorm, not an RMSNorm).
_NORM_EPS_KEYS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class TargetFacts:
    """The target's shape and the settings a drafter or a decoder must match."""

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None
    rms_norm_eps: float | None             # the final norm's epsilon (LayerNorm's for GPT-2)
    rope_theta: float | None               # RoPE base of the full-attention layers; None: no RoPE (GPT-2)
    rope_parameters: dict[str, Any] | None  # as transformers holds it: one dict, or one per layer type
    layer_types: tuple[str, ...]           # per layer: "full_attention", "sliding_attention", ...
    sliding_window: int | None
    tie_word_embeddings: bool              # the LM head shares the embedding matrix
    eos_token_ids: tuple[int, ...]         # config and generation_config EOS ids, sorted

    @property
    def full_attention_only(self) -> bool:
        return all(kind == FULL_ATTENTION for kind in self.layer_types)

    def architecture(self) -> dict[str, Any]:
        """The manifest's `target["architecture"]`: ARCHITECTURE_KEYS, plus the attention layout and
        per-layer-type RoPE only where the target has them (so full-attention targets keep the old dict)."""
        record = {key: getattr(self, key) for key in ARCHITECTURE_KEYS}
        if not self.full_attention_only:
            record.update(layer_types=list(self.layer_types), sliding_window=self.sliding_window)
        if _per_layer_type(self.rope_parameters):
            record["rope_parameters"] = self.rope_parameters
        return record


def read_target_facts(model_path: str | Path, *, trust_remote_code: bool = False) -> TargetFacts:
    """The facts of the local transformers model in `model_path` (one-line ValueError when it has none)."""
    from transformers import AutoConfig

    root = Path(model_path)
    if not (root / "config.json").is_file():
        raise ValueError(f"--model {model_path}: no config.json; pass a local transformers model directory")
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(f"--model {model_path}: {_config_problem(root, error)}") from None
    facts = facts_from_config(config, where=f"--model {model_path}")
    return replace(facts, eos_token_ids=tuple(sorted(set(facts.eos_token_ids) | _generation_eos(root))))


def facts_from_config(config: Any, *, where: str) -> TargetFacts:
    """The facts of a loaded transformers config (`where` names its source in errors)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = {key: getattr(text, key, None) for key in ARCHITECTURE_KEYS}
    values["intermediate_size"] = _intermediate_size(text)
    values["rms_norm_eps"] = next((getattr(text, k) for k in _NORM_EPS_KEYS if getattr(text, k, None) is not None),
                                  None)
    values["rope_parameters"] = getattr(text, "rope_parameters", None)
    missing = [key for key in (*_REQUIRED, "intermediate_size") if values[key] is None]
    if missing:
        raise ValueError(f"{where}: the {getattr(text, 'model_type', '?')} config has no {missing[0]!r}; "
                         "this target cannot be sized (is config.json complete?)")
    values = derive(values)
    num_layers = int(values["num_hidden_layers"])
    sliding_window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:  # older configs: one window for every layer (Mistral), or none
        layer_types = [SLIDING_ATTENTION if sliding_window else FULL_ATTENTION] * num_layers
    eos = [getattr(text, "eos_token_id", None), getattr(config, "eos_token_id", None)]
    return TargetFacts(
        model_type=str(getattr(text, "model_type", "") or getattr(config, "model_type", "")),
        num_hidden_layers=num_layers, hidden_size=int(values["hidden_size"]),
        num_attention_heads=int(values["num_attention_heads"]),
        num_key_value_heads=int(values["num_key_value_heads"]), head_dim=int(values["head_dim"]),
        intermediate_size=int(values["intermediate_size"]), vocab_size=int(values["vocab_size"]),
        max_position_embeddings=values["max_position_embeddings"], rms_norm_eps=values["rms_norm_eps"],
        rope_theta=values["rope_theta"], rope_parameters=values["rope_parameters"],
        layer_types=tuple(str(kind) for kind in layer_types), sliding_window=sliding_window,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        eos_token_ids=tuple(sorted(token_ids(eos))))


def architecture_values(arch: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest form of `arch`: a store's `target["architecture"]` (derived facts filled in), or a
    transformers `config.to_dict()` (read through transformers, like a model folder)."""
    if "model_type" in arch:
        from transformers import AutoConfig

        values = dict(arch)
        model_type = values.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **values)
        except ValueError:  # a model_type with its own code (trust_remote_code): read the dict as it is
            logger.debug("transformers does not know model_type %r; reading its config dict as stored", model_type)
        else:
            return facts_from_config(config, where=f"the {model_type} config").architecture()
    return derive(dict(arch))


def derive(values: dict[str, Any]) -> dict[str, Any]:
    """Fill the facts a config may leave implicit: KV heads (= heads, no GQA), head_dim (= width / heads)
    and the RoPE base (transformers 5 keeps it in rope_parameters, per layer type for Gemma 3)."""
    heads, width = values.get("num_attention_heads"), values.get("hidden_size")
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = heads
    if values.get("head_dim") is None and heads and width:
        values["head_dim"] = int(width) // int(heads)
    if values.get("rope_theta") is None:
        values["rope_theta"] = _rope_theta(values.get("rope_parameters"))
    return values


def _per_layer_type(rope_parameters: Mapping[str, Any] | None) -> bool:
    return bool(rope_parameters) and all(isinstance(v, Mapping) for v in rope_parameters.values())


def _rope_theta(rope_parameters: Mapping[str, Any] | None) -> float | None:
    """The RoPE base; with one parameter set per layer type, the full-attention layers' (the drafter
    attends over the whole context, as those layers do)."""
    if not rope_parameters:
        return None
    if _per_layer_type(rope_parameters):
        chosen = rope_parameters.get(FULL_ATTENTION) or next(iter(rope_parameters.values()))
        return chosen.get("rope_theta")
    return rope_parameters.get("rope_theta")


def _intermediate_size(text: Any) -> int | None:
    """The MLP width; Falcon calls it ffn_hidden_size, GPT-2-style configs n_inner (None: 4 x width)."""
    size = getattr(text, "intermediate_size", None) or getattr(text, "ffn_hidden_size", None)
    if size is None and hasattr(text, "n_inner"):
        size = text.n_inner or 4 * int(text.hidden_size)
    return size


def token_ids(candidates: list[Any]) -> set[int]:
    """The ids among config values that may each be an id, a list of ids, or None (EOS ids are all three)."""
    ids: set[int] = set()
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, (list, tuple)):
            ids.update(int(c) for c in candidate)
    return ids


def _generation_eos(root: Path) -> set[int]:
    """EOS ids of generation_config.json, which chat models often extend (e.g. an end-of-turn token)."""
    if not (root / "generation_config.json").is_file():
        return set()
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, OSError) as error:
        logger.warning("%s/generation_config.json unreadable (%s); using config.json's EOS ids", root, error)
        return set()
    return token_ids([generation.eos_token_id])


def _config_problem(root: Path, error: Exception) -> str:
    """One line saying why transformers refused `root`/config.json."""
    try:
        raw = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as parse_error:
        return f"config.json is not valid JSON ({parse_error}); fix or replace it"
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        return "config.json has no model_type; it is not a transformers model config"
    from transformers import __version__

    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "does not recognize this architecture" in first_line or "Unrecognized" in first_line:
        return (f"model_type {model_type!r} is unknown to transformers {__version__}; upgrade transformers, "
                "or pass --trust-remote-code for a model that ships its own code")
    if "custom code" in first_line or "trust_remote_code" in first_line:
        return (f"model_type {model_type!r} is defined by code shipped in the folder (auto_map), which runs only "
                "with --trust-remote-code; read that code, then pass the flag if you trust it")
    return f"transformers cannot read config.json ({first_line})"
