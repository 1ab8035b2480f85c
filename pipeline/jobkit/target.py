"""The target as every job sees it: its fingerprint (part of each job's identity) and its tokenizer."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from beagle.target_facts import read_target_facts
from beagle.target_model import load_tokenizer as load_target_tokenizer
from beagle.target_model import weights_sha256


def target_fingerprint(model_path: str, dtype: str, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """The manifest's `target`: name, hashes of config and weights (files in name order), architecture."""
    root = Path(model_path)
    weights = weights_sha256(model_path)
    facts = read_target_facts(model_path, trust_remote_code=trust_remote_code)
    config = json.loads((root / "config.json").read_text())  # only for the name the model was saved under
    return {"name": config.get("_name_or_path") or root.name,
            "config_sha256": hashlib.sha256((root / "config.json").read_bytes()).hexdigest(),
            "weights_sha256": weights, "dtype": dtype, "architecture": facts.architecture()}


def load_tokenizer(model_path: str, *, trust_remote_code: bool = False) -> Any:
    """Load the target's tokenizer from a local directory; one-line ValueError when it cannot be used.
    A fast (Rust) one only: extraction's exact loss masks need its character offsets."""
    tokenizer = load_target_tokenizer(model_path, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"--model {model_path}: the tokenizer is not a fast (Rust) tokenizer; exact loss masks "
                         "need its character offsets; add a tokenizer.json to the model directory")
    return tokenizer
