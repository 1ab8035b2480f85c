"""Save and load a trained drafter: `model.safetensors` (trainable weights only) + `config.json`.

The frozen embedding and LM head are the target's own; they are not copied into the drafter
directory, the loader takes them from the target (or a feature store's head) instead.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from beagle.model import DrafterConfig
from beagle.registry import form_named
from pipeline.store import atomic
from pipeline.store.hashing import BLAKE3, bytes_checksum, checksum_entry, entry_checksum, new_digest, update_from_file

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
WEIGHTS_ENTRY = "weights"  # config.json's {"bytes": N, "blake3": hex} of model.safetensors, as a store lists its files


def save_drafter(directory: str | os.PathLike, model: torch.nn.Module, *,
                 metadata: dict[str, Any]) -> None:
    """Write the drafter's trainable weights and a config.json with DrafterConfig + metadata.

    metadata typically carries the store dataset_id(s) and target fingerprints, so that `eval`
    can refuse a target the drafter was not trained for."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    payload = save(weights, metadata={"format": "pt"})
    atomic.write_bytes(directory / WEIGHTS_NAME, payload)
    config = {**metadata, **model.config.to_dict(), "drafter_type": model.drafter_type,
              WEIGHTS_ENTRY: checksum_entry(BLAKE3, bytes_checksum(payload, BLAKE3), len(payload))}
    atomic.write_text(directory / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    log.info("exported drafter to %s (%d tensors)", directory, len(weights))


def read_drafter_meta(config_path: str | os.PathLike) -> dict[str, Any]:
    """A drafter folder's config.json, or a one-line ValueError naming the file and the fix: not JSON, not
    an object, or an engine export (EAGLE-3/EAGLE layout for vLLM and SGLang), which is ours to write, not
    to read back."""
    config_path = Path(config_path)
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path} is not valid JSON ({type(error).__name__}); the drafter folder is "
                         "damaged: re-export it or retrain") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{config_path} holds a {type(meta).__name__}, not a drafter config (a JSON object); "
                         "the drafter folder is damaged: re-export it or retrain")
    if "speculators_config" in meta or any("Eagle" in str(a) for a in meta.get("architectures") or ()):
        raise ValueError(f"{config_path.parent} is an engine export (EAGLE layout, for vLLM or SGLang), not a "
                         "drafter of ours; pass the training run (RUN or RUN/drafter) or an "
                         "`export --format native` copy")
    return meta


def check_weights_checksum(weights_path: str | os.PathLike, entry: Any) -> None:
    """The file's length and checksum against config.json's `weights` entry (a one-line ValueError on a
    mismatch). A folder written before drafters carried checksums has no entry and passes unchecked."""
    if entry is None:
        return
    damaged = "the drafter folder is damaged: re-export it or retrain"
    try:
        algorithm, expected = entry_checksum(entry, where=f"{Path(weights_path).parent / CONFIG_NAME}: weights")
        size = int(entry["bytes"])
    except Exception as error:
        raise ValueError(f"{str(error).splitlines()[0]}; {damaged}") from None
    actual_size = os.path.getsize(weights_path)
    if actual_size != size:
        raise ValueError(f"{weights_path} holds {actual_size} bytes, its config.json records {size}; {damaged}")
    actual = update_from_file(new_digest(algorithm), weights_path).hexdigest()
    if actual != expected:
        raise ValueError(f"{weights_path}: {algorithm} {actual[:16]}… differs from the {expected[:16]}… its "
                         f"config.json records; {damaged}")


def read_weights(weights_path: str | os.PathLike, *, check_only: bool = False,
                 checksum: Any = None) -> dict[str, Tensor]:
    """A drafter's model.safetensors, or a one-line ValueError when it is damaged: its length and checksum
    against `checksum` (config.json's `weights` entry, when the folder has one: a flipped byte anywhere), then
    safetensors' own checks (every byte of the header, the file's length). `check_only`: the checks alone (the
    header is parsed, no tensor is read), returning {}."""
    from safetensors import safe_open

    check_weights_checksum(weights_path, checksum)
    try:
        if check_only:
            with safe_open(str(weights_path), framework="pt"):
                return {}
        return load_file(str(weights_path))
    except Exception as error:  # safetensors raises its own error types (SafetensorError) for damage
        raise ValueError(f"{weights_path} is not a whole safetensors file ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}); the drafter is damaged: "
                         "re-export it or retrain") from None


def load_drafter(directory: str | os.PathLike, *, embed_tokens: Tensor, lm_head: Tensor,
                 device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild a drafter from `save_drafter` output and the target's frozen embedding / LM head; the
    class follows config.json's drafter_type (a form of beagle/registry.py)."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; point --drafter at a RUN/drafter directory "
                                    "written by `beagle-pipeline train`")
    meta = read_drafter_meta(config_path)
    form = form_named(meta.get("drafter_type"), where=f"{config_path}: drafter_type")
    names = DrafterConfig.__dataclass_fields__.keys()
    config = DrafterConfig.from_dict({k: meta[k] for k in names if k in meta})
    model = form.build(config, embed_tokens, lm_head)
    state = read_weights(weights_path, checksum=meta.get(WEIGHTS_ENTRY))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not match the drafter config: missing={missing}, "
                         f"unexpected={unexpected}")
    return model.to(device=device, dtype=dtype).eval(), meta
