"""Load a target model and the drafter trained for it, refusing a drafter that cannot fit the target."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from beagle.decoding.verify import check_supported
from beagle.devices import torch_dtype
from beagle.errors import InputError
from beagle.drafter_folder import CONFIG_NAME, load_drafter, read_drafter_meta
from beagle.target_facts import facts_from_config, read_target_facts
from beagle.target_model import TargetSpec, check_weights_match, weights_sha256

logger = logging.getLogger(__name__)


def load_target(target: TargetSpec | str | Path, dtype: str | None = None, device: torch.device | None = None):
    """The target causal LM and its tokenizer, from a local directory (never the hub at eval time).

    `target`: a TargetSpec, or a folder with `dtype` (then no remote code runs)."""
    spec = target if isinstance(target, TargetSpec) else TargetSpec(str(target), dtype or "float32")
    device = device if device is not None else torch.device("cpu")
    path = Path(spec.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} not found; --model must be a local HF model directory")
    # an unknown model_type is refused here, before any weight is read
    facts = read_target_facts(path, trust_remote_code=spec.trust_remote_code)
    logger.info("target %s (%s): %d layers, width %d, vocabulary %d", path, facts.model_type,
                facts.num_hidden_layers, facts.hidden_size, facts.vocab_size)
    check_weights_match(path, facts.hidden_size, facts.vocab_size, facts.num_hidden_layers)
    tokenizer = spec.load_tokenizer()
    model = spec.load_model(device)
    check_supported(model)
    return model, tokenizer


def load_drafter_for(drafter_dir: str | Path, model, dtype: str, device: torch.device, *,
                     allow_other_weights: bool = False):
    """The drafter with the target's own frozen embedding and LM head, after checking it was built for
    a target of the same width and vocabulary, and of the same weights where the drafter records their
    sha256 (`allow_other_weights` accepts others, e.g. a fine-tune, with a warning); a warning when
    the target's config differs."""
    drafter_dir = Path(drafter_dir)
    config_path = drafter_dir / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; point --drafter at RUN/drafter written by "
                                "`beagle-pipeline train`")
    meta = read_drafter_meta(config_path)
    target_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    for key, actual in (("hidden_size", embed.shape[1]), ("vocab_size", head.shape[0])):
        if meta.get(key) is not None and int(meta[key]) != int(actual):
            raise InputError(f"drafter {drafter_dir} was trained for {key}={meta[key]} but the target has "
                             f"{key}={actual}; pass the --model the drafter was trained on")
    layers = facts_from_config(model.config, where=f"--model {model.config.name_or_path}").num_hidden_layers
    deeper = [layer for layer in meta.get("key_layers", [-1]) if layer != -1 and layer >= layers]
    if deeper:
        raise InputError(f"drafter {drafter_dir} fuses target layers {meta['key_layers']} but the target has "
                         f"{layers} layers; pass the --model the drafter was trained on")
    trained_for = (meta.get("target") or {}).get("config_sha256")
    model_config = Path(getattr(target_config, "_name_or_path", "") or "") / "config.json"
    if trained_for and model_config.is_file():
        if hashlib.sha256(model_config.read_bytes()).hexdigest() != trained_for:
            logger.warning("drafter %s was trained on a target whose config.json differs from %s; "
                           "acceptance may be poor", drafter_dir, model_config)
    _check_weights(drafter_dir, meta, Path(getattr(target_config, "_name_or_path", "") or ""), allow_other_weights)
    drafter, _ = load_drafter(drafter_dir, embed_tokens=embed.detach(), lm_head=head.detach(),
                              device=device, dtype=torch_dtype(dtype))
    return drafter, meta


def _check_weights(drafter_dir: Path, meta: dict, model_dir: Path, allow_other_weights: bool) -> None:
    """A drafter is trained on one target's hidden states: a target of the same shape with other weights
    (a fine-tune, another checkpoint) is refused unless allowed. Costs one more read of the weight files,
    mostly from the page cache as the model was just loaded from them (skipped when allowed)."""
    trained_for = (meta.get("target") or {}).get("weights_sha256")
    if not trained_for or not (model_dir / "config.json").is_file():
        return
    if allow_other_weights:
        logger.warning("drafter %s: not checking that %s has the weights it was trained on "
                       "(--allow-other-target-weights)", drafter_dir, model_dir)
        return
    actual = weights_sha256(model_dir)
    if actual != trained_for:
        raise InputError(f"drafter {drafter_dir} was trained on a target whose weights have sha256 "
                         f"{trained_for[:12]}…, but --model {model_dir} has {actual[:12]}… (same shape, other "
                         "weights); pass the --model the drafter was trained on, or --allow-other-target-weights "
                         "to evaluate it anyway (outputs stay the target's own; acceptance, so speed, may be poor)")
