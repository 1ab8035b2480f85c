"""Loading a user's target model: the one place that reads its weights (`extract`, `regenerate`, `eval`).

The rules (docs/reliability.md, "Untrusted models"):
- local files only: the hub is never contacted, whatever the folder's config says;
- weights in safetensors are loaded as they are; pickle-based files (`.bin`, `.pt`, `.pth`) only through
  torch's `weights_only` loader, which executes no code, and that loader is trusted from torch 2.6 on
  (CVE-2025-32434 broke it before): on an older torch they are refused with how to convert them;
- model code shipped in the folder runs only with `trust_remote_code`;
- the model lands on one device by `.to(device)`; `device_map` (accelerate) only when asked for.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from beagle.devices import torch_dtype

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
SAFE_WEIGHTS_ONLY_TORCH = (2, 6)  # the weights_only unpickler is safe from this version on


@dataclass(frozen=True)
class TargetSpec:
    """Everything that says how a command opens a user's target, in one value: where its local folder is,
    in which dtype it runs, whether the model code shipped in its folder may run (`trust_remote_code`, off
    unless the user says so), and how to place it (`device_map`, accelerate's, for a target too big for
    one device). `extract`, `regenerate` and `eval` take their `--model`, `--dtype`, `--trust-remote-code`
    and `--device-map` flags into one of these."""

    path: str
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    device_map: str | None = None

    def load_model(self, device: torch.device) -> Any:
        return load_causal_lm(self.path, dtype=self.dtype, device=device, trust_remote_code=self.trust_remote_code,
                              device_map=self.device_map)

    def load_tokenizer(self) -> Any:
        return load_tokenizer(self.path, trust_remote_code=self.trust_remote_code)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def weight_files(model_path: str | Path) -> list[Path]:
    """The files holding the weights; a one-line ValueError when the folder cannot be used as a target.

    Pickle-based weights are refused unless a safetensors copy sits next to them (transformers prefers
    it) or torch's weights_only loader is safe on this torch."""
    root = Path(model_path)
    if not root.is_dir():
        raise ValueError(f"--model {model_path}: not a directory; pass a local model directory (the hub is not used)")
    if not (root / "config.json").is_file():
        raise ValueError(f"--model {model_path}: no config.json; this is not a transformers model directory")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
                   and not p.name.startswith("training_args"))
    if not files:
        raise ValueError(f"--model {model_path}: no weight files (*.safetensors or *.bin) next to config.json")
    pickled = [p for p in files if p.name.endswith(PICKLE_SUFFIXES)]
    has_safetensors = any(p.name.endswith(".safetensors") for p in files)
    if pickled and not has_safetensors and torch_version() < SAFE_WEIGHTS_ONLY_TORCH:
        raise ValueError(
            f"--model {model_path}: {pickled[0].name} is a pickle, which torch {torch.__version__} cannot load "
            f"without the risk of running code in it (torch >= 2.6 can); convert it to safetensors "
            "(load it once where you trust it, then model.save_pretrained(dir, safe_serialization=True))")
    return files


def weights_sha256(model_path: str | Path) -> str:
    """The sha256 a store's manifest records for a target's weights (`target.weights_sha256`): each
    weight file's name and bytes, in name order. One read of the weights, streamed."""
    import hashlib

    from pipeline.store.hashing import update_from_file

    digest = hashlib.sha256()
    for path in weight_files(model_path):
        digest.update(path.name.encode() + b"\0")
        update_from_file(digest, path)
    return digest.hexdigest()


# Names of the input embedding across families: Llama-style, GPT-2, Falcon/BLOOM, GPT-NeoX, older Llama ports.
_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
                    "tok_embeddings.weight")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def check_weights_match(model_path: str | Path, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Refuse, from the safetensors headers alone (no tensor is read), weights that do not match the config:
    an input embedding of another shape than [vocab_size, hidden_size], or fewer decoder layers than
    num_hidden_layers. Called before any worker starts, so that a mismatched folder fails at once rather than
    in every Ray actor. Pickle-only folders are not checked (their shapes cannot be read without loading);
    extra layers (e.g. multi-token-prediction heads) are allowed, as transformers allows them."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), framework="np") as handle:
            shapes.update((name, handle.get_slice(name).get_shape()) for name in handle.keys())
    if not shapes:
        return
    embedding = next(((name, shape) for name, shape in shapes.items()
                      if name.endswith(_EMBEDDING_NAMES) and len(shape) == 2), None)
    if embedding and list(embedding[1]) != [vocab_size, hidden_size]:
        raise ValueError(f"--model {model_path}: its weights do not match config.json: {embedding[0]} is "
                         f"{list(embedding[1])}, the config says [vocab_size={vocab_size}, hidden_size={hidden_size}]")
    layers = {int(match.group(1)) for name in shapes if (match := _LAYER_INDEX.search(name))}
    if layers and max(layers) + 1 < num_layers:
        raise ValueError(f"--model {model_path}: its weights do not match config.json: they hold {max(layers) + 1} "
                         f"decoder layers, the config says num_hidden_layers={num_layers}")


def read_head_weights(model_path: str | Path, dtype: str,
                      trust_remote_code: bool = False) -> dict[str, torch.Tensor] | None:
    """The input embedding and LM head (`[V, d]` each, in `dtype`) read from the safetensors files alone, or
    None when they cannot be found there (pickle weights, a head that a conversion on load would transform).

    For the rare resume where every shard was committed but the head was not: the driver then needs two
    tensors, not the whole target on its CPU. Checkpoint names are mapped to the model's as
    `from_pretrained` maps them (transformers' renamings and base-prefix rule, e.g. GPT-NeoX's `embed_out`
    -> `lm_head`), against the model built on the meta device (no memory); a tied head saved once is the
    embedding."""
    from safetensors import safe_open

    if not sorted(Path(model_path).glob("*.safetensors")):
        return None
    skeleton = _meta_skeleton(model_path, trust_remote_code)
    names: dict[int, list[str]] = {}  # a tied head is one parameter under two names, the embedding's first
    for name, parameter in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    roles = {"embed_tokens": skeleton.get_input_embeddings(), "lm_head": skeleton.get_output_embeddings()}
    wanted: dict[str, list[str]] = {}  # model parameter name -> the roles it plays (both, when tied)
    for role, module in roles.items():
        for name in names.get(id(getattr(module, "weight", None)), []):
            wanted.setdefault(name, []).append(role)
    located: dict[str, tuple[Path, str]] = {}
    for name, where in _locate_parameters(model_path, skeleton, set(wanted)).items():
        for role in wanted[name]:
            located.setdefault(role, where)
    if len(located) < len(roles):
        log.info("%s: the embedding or LM head is not found by name in its safetensors files", model_path)
        return None
    head = {}
    for role, (path, key) in located.items():
        with safe_open(str(path), framework="pt") as handle:
            head[role] = handle.get_tensor(key).to(torch_dtype(dtype))
    return head if head["lm_head"].shape == head["embed_tokens"].shape else None


def _meta_skeleton(model_path: str | Path, trust_remote_code: bool) -> torch.nn.Module:
    """The target's causal LM built on the meta device (no memory): its parameter names and modules."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def _locate_parameters(model_path: str | Path, skeleton: torch.nn.Module,
                       names: set[str]) -> dict[str, tuple[Path, str]]:
    """{model parameter name: (safetensors file, checkpoint key)} for those of `names` the folder's safetensors
    files hold (the first file in name order wins), checkpoint keys mapped as `from_pretrained` maps them."""
    from safetensors import safe_open

    to_model_name = _checkpoint_key_mapper(skeleton)
    located: dict[str, tuple[Path, str]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                name = to_model_name(key)
                if name in names:
                    located.setdefault(name, (path, key))
    return located


def _checkpoint_key_mapper(skeleton: torch.nn.Module):
    """checkpoint key -> the model's parameter name, as `from_pretrained` renames it; None for a key that a
    weight converter would transform (its tensor is not the parameter as stored)."""
    meta_names = {name: True for name, _ in skeleton.named_parameters(remove_duplicate=False)}  # .get() must be truthy
    prefix = skeleton.base_model_prefix
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # another transformers layout: the names as they are, with or without the prefix
        def plain(key: str) -> str:
            for name in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")):
                if name in meta_names:
                    return name
            return key
        return plain
    mapping = get_model_conversion_mapping(skeleton)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]

    def renamed(key: str) -> str | None:
        name, converted = rename_source_key(key, renamings, converters, prefix, meta_names)
        if name not in meta_names and key in meta_names:
            name, converted = rename_source_key(key, [], [], prefix, meta_names)
        return None if converted is not None else name
    return renamed


def load_causal_lm(model_path: str | Path, *, dtype: str, device: torch.device, trust_remote_code: bool = False,
                   device_map: str | None = None) -> Any:
    """The target, in eval mode, on `device` (or spread by `device_map`, which needs accelerate)."""
    from transformers import AutoModelForCausalLM

    weight_files(model_path)
    if device_map:
        import importlib.util
        if importlib.util.find_spec("accelerate") is None:
            raise ValueError(f"--device-map {device_map!r} needs the accelerate package; pip install accelerate "
                             "(on every node)")
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype(dtype), local_files_only=True,
                                                 trust_remote_code=trust_remote_code, device_map=device_map)
    model = model.eval()
    return model if device_map else model.to(device)


def load_tokenizer(model_path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer from its local folder; a one-line ValueError when it cannot be used."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model {model_path}: cannot load its tokenizer ({first})") from None
    return tokenizer


def final_norm_module(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(its name, the module) of the norm the base model applies to its last layer's output: the last
    direct child of the base model whose class is a norm (`model.norm`, GPT-2's `transformer.ln_f`, Phi's
    `model.final_layernorm`), or None when there is no such child."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    base, base_name = (base, f"{prefix}.") if isinstance(base, torch.nn.Module) else (model, "")
    norms = [(f"{base_name}{name}", child) for name, child in base.named_children()
             if "norm" in type(child).__name__.lower() or "ln_f" == name]
    return norms[-1] if norms else None


def read_final_norm(model_path: str | Path, trust_remote_code: bool = False) -> torch.nn.Module:
    """The target's final norm (float32, on the CPU), its weights read by name from the safetensors files when
    they hold it (two small tensors, not the whole target), else from the model loaded once.

    An EAGLE-3 trainer that takes the verifier's last state *before* that norm (speculators) needs it to
    turn our stored state (after the norm) back into one the norm maps to the same values."""
    from safetensors import safe_open

    skeleton = _meta_skeleton(model_path, trust_remote_code)
    found = final_norm_module(skeleton)
    if found is None:
        raise ValueError(f"--model {model_path}: no final norm found under its base model "
                         f"({type(skeleton).__name__}); this export needs the norm the LM head reads through")
    name, norm = found
    wanted = {f"{name}.{parameter}": parameter for parameter, _ in norm.named_parameters()}
    values: dict[str, torch.Tensor] = {}
    for full_name, (path, key) in _locate_parameters(model_path, skeleton, set(wanted)).items():
        with safe_open(str(path), framework="pt") as handle:
            values[wanted[full_name]] = handle.get_tensor(key).float()
    if len(values) == len(wanted) and not list(norm.buffers()):
        norm = norm.to_empty(device="cpu").float()
        norm.load_state_dict(values)
        return norm.eval()
    model = load_causal_lm(model_path, dtype="float32", device=torch.device("cpu"),
                           trust_remote_code=trust_remote_code)
    loaded = final_norm_module(model)
    assert loaded is not None  # the same class as the skeleton's
    return loaded[1].eval()
