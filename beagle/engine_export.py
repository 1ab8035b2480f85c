"""Export a trained drafter in the formats serving engines load (docs/engine-export.md).

* EAGLE-3 (`export_eagle3`): the engine-form Beagle (drafter_type "beagle-state", `train --residual state`) is
  exactly one EAGLE-3 layer (beagle/state_beagle.py), written in the speculators layout that vLLM and
  speculators load (`layers.0.*`, a `speculators_config`) or in SGLang/SpecForge's (`midlayer.*`, a flat
  Llama config). EAGLE-3's q/k/v read [input_layernorm(emb); hidden_norm(s)]: ours read the embedding
  alone (q) and the state alone (k, v), so q_proj = [W_q, 0], k_proj = [0, W_k], v_proj = [0, W_v].
* EAGLE (`export_eagle`): the EAGLE-2 baseline (drafter_type "eagle2") in vLLM's `method: "eagle"` layout
  (llama_eagle.py: fc without bias over [emb; h], one Llama layer without input norm, the target's head).
* native (`export_native`): this project's own RUN/drafter folder, copied.

Which form may be written in which format is its row of beagle/registry.py (`exports`); each writer here checks
what only it knows. Whatever an engine would compute differently is refused with a ValueError naming it (an fc
bias vLLM drops, a draft vocabulary EAGLE cannot hold, a key layer an engine cannot read);
nothing is ever written approximately. Each export is built in a hidden folder next to `out_dir`, fsynced
and renamed into place (pipeline/store/atomic.py), so a reader sees the whole export or none.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save
from torch import Tensor, nn

from beagle.layer_capture import eagle3_aux_layers
from beagle.drafter_folder import (CONFIG_NAME, WEIGHTS_ENTRY, WEIGHTS_NAME, load_drafter, read_drafter_meta,
                                   read_weights, save_drafter)
from beagle.registry import bare_drafter, form_of
from pipeline.store import atomic

log = logging.getLogger(__name__)

LAYOUTS = {"speculators": "eagle3", "sglang": "eagle3-sglang"}  # EAGLE-3 layout -> its export format
SGLANG_AUX_LAYERS = 3  # SGLang's LlamaForCausalLMEagle3 fc: Linear(3 * hidden, hidden); vLLM >= 0.32 reads num_aux_hidden_states
PROVENANCE_NAME = "beagle_export.json"   # what was exported from what; engines ignore it
SPECULATORS_VERSION = "0.9.0"            # the speculators release whose Eagle3SpeculatorConfig this layout follows
DEFAULT_MAX_POSITIONS = 4096             # when the target's config has none (vLLM raises it to max_model_len)

# Engine-form Beagle -> EAGLE-3 (speculators/vLLM names; SGLang's are these with "layers.0." -> "midlayer.").
# q/k/v are widened to [*, 2d] (see the module docstring); the LM head rows come from the target.
# The block's layers (beagle/block.py) under a Llama decoder layer's names, shared by both layouts.
_BLOCK_NAMES = {
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "post_attention_norm.weight": "layers.0.post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",
}
EAGLE3_NAMES = {
    "layer_fusion.proj.weight": "fc.weight",
    "input_norm.weight": "layers.0.input_layernorm.weight",
    "kv_norm.weight": "layers.0.hidden_norm.weight",
    **_BLOCK_NAMES,
    "output_norm.weight": "norm.weight",
}
# EAGLE-2 baseline -> vLLM EAGLE (llama_eagle.py). fc.bias is checked to be zero and left out.
EAGLE_NAMES = {"fc.weight": "fc.weight", **_BLOCK_NAMES}


@dataclass(frozen=True)
class EngineTarget:
    """What an engine checkpoint records of the target, and the target's frozen head when the drafter is
    given as a folder (its config.json holds only the trained weights). embed_tokens, lm_head: [V, d]."""

    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int | None = None
    architectures: tuple[str, ...] = ()
    name_or_path: str | None = None          # the verifier folder an engine or speculators loads the target from
    eos_token_ids: tuple[int, ...] = ()      # added to a reduced draft vocabulary, as `eval` drafts
    embed_tokens: Tensor | None = field(default=None, repr=False)
    lm_head: Tensor | None = field(default=None, repr=False)


def target_from_model_dir(path: str | os.PathLike, *, with_head: bool = True) -> EngineTarget:
    """The facts (and, with_head, the embedding and LM head in fp32) of a local transformers target folder."""
    from beagle.target_facts import read_target_facts
    from beagle.target_model import read_head_weights

    root = Path(path)
    facts = read_target_facts(root)
    raw = json.loads((root / "config.json").read_text(encoding="utf-8"))
    head = None
    if with_head:
        head = read_head_weights(root, "float32")
        if head is None:  # a head only the model class can assemble: load the model once
            from beagle.target_model import load_causal_lm

            model = load_causal_lm(root, dtype="float32", device=torch.device("cpu"))
            head = {"embed_tokens": model.get_input_embeddings().weight.detach(),
                    "lm_head": model.get_output_embeddings().weight.detach()}
    return EngineTarget(vocab_size=facts.vocab_size, num_hidden_layers=facts.num_hidden_layers,
                        max_position_embeddings=facts.max_position_embeddings,
                        architectures=tuple(raw.get("architectures") or ()), name_or_path=str(root.resolve()),
                        eos_token_ids=facts.eos_token_ids,
                        embed_tokens=None if head is None else head["embed_tokens"],
                        lm_head=None if head is None else head["lm_head"])


def target_from_store(url: str) -> EngineTarget:
    """The facts and frozen head a feature store recorded of its target (no verifier path: the store does
    not say where the target lives)."""
    from beagle.torch_store import open_store

    store = open_store(url)
    arch = store.manifest["target"]["architecture"]
    head = store.load_head()
    return EngineTarget(vocab_size=int(arch["vocab_size"]), num_hidden_layers=int(arch["num_hidden_layers"]),
                        max_position_embeddings=arch.get("max_position_embeddings"),
                        embed_tokens=head["embed_tokens"], lm_head=head["lm_head"])


# --------------------------------------------------------------------------------------------- resolving

def _resolve(drafter: str | os.PathLike | nn.Module, target: EngineTarget,
             draft_vocab: Sequence[int] | None) -> tuple[nn.Module, dict[str, Any], list[int] | None]:
    """(the bare drafter module, its config.json metadata, its draft vocabulary or None) from a drafter
    folder, a loaded drafter, or a ReducedVocabDrafter (whose `tokens` are the vocabulary)."""
    meta: dict[str, Any] = {}
    if isinstance(drafter, (str, os.PathLike)):
        directory = Path(drafter)
        if target.embed_tokens is None or target.lm_head is None:
            raise ValueError(f"exporting {directory} needs the target's embedding and LM head: pass the target "
                             "folder (--target) or a feature store of it")
        drafter, meta = load_drafter(directory, embed_tokens=target.embed_tokens.float(),
                                     lm_head=target.lm_head.float())
        if draft_vocab is None:
            draft_vocab = meta.get("draft_vocab")
    else:  # a drafter, or a reduced-vocabulary view of one: the drafter and its columns
        drafter, columns = bare_drafter(drafter)
        if draft_vocab is None and columns is not None:
            draft_vocab = columns.tolist()
    c = drafter.config
    if c.vocab_size != target.vocab_size:
        raise ValueError(f"the drafter has vocab_size={c.vocab_size} but the target {target.vocab_size}; "
                         "pass the target the drafter was trained on")
    vocab = None
    if draft_vocab:
        ids = sorted({int(t) for t in draft_vocab} | {int(t) for t in target.eos_token_ids})
        bad = [t for t in ids if not 0 <= t < c.vocab_size]
        if bad:
            raise ValueError(f"draft vocabulary ids {bad[:5]} are outside the target's vocabulary of {c.vocab_size}")
        vocab = None if len(ids) == c.vocab_size else ids
    return drafter, meta, vocab


def _vocab_maps(vocab: list[int], vocab_size: int) -> tuple[Tensor, Tensor]:
    """d2t [N] int64 (draft id j -> target id j + d2t[j]) and t2d [V] bool (target id is drafted)."""
    ids = torch.tensor(vocab, dtype=torch.long)
    d2t = ids - torch.arange(len(vocab), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    assert int(t2d.sum()) == len(vocab), "d2t must be injective: draft ids map to distinct target ids"
    return d2t, t2d


def _llama_config(c, target: EngineTarget, dtype: torch.dtype) -> dict[str, Any]:
    """The one decoder layer as a Llama config: the drafter's shape, plain RoPE at its theta, the target's
    vocabulary and context length."""
    return {
        "model_type": "llama", "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "vocab_size": target.vocab_size,
        "max_position_embeddings": int(target.max_position_embeddings or DEFAULT_MAX_POSITIONS),
        "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "dtype": str(dtype).removeprefix("torch."),
    }


def _check_covered(model: nn.Module, names: dict[str, str], skipped: set[str] = frozenset()) -> None:
    """Every trained tensor has a place in the export: an unmapped one would silently change the drafter."""
    unmapped = sorted(set(model.state_dict()) - set(names) - set(skipped))
    if unmapped:
        raise ValueError(f"the drafter has weights {unmapped} that the engine layout has no place for")


# --------------------------------------------------------------------------------------------- EAGLE-3

def eagle3_tensors(model: nn.Module, vocab: list[int] | None, *, embed_tokens: bool,
                   dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The speculators-layout tensors of an engine-form Beagle (names of EAGLE3_NAMES, plus lm_head, d2t/t2d
    for a reduced vocabulary, embed_tokens when asked)."""
    _check_covered(model, EAGLE3_NAMES, skipped={"q_state_proj.weight"})
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    q_state = state.pop("q_state_proj.weight", None)                                    # --query-state
    out = {EAGLE3_NAMES[k]: v for k, v in state.items()}
    q, k, v = state["q_proj.weight"], state["k_proj.weight"], state["v_proj.weight"]   # [H*hd, d], [Hkv*hd, d]
    q_right = torch.zeros_like(q) if q_state is None else q_state                      # the state half of q
    out["layers.0.self_attn.q_proj.weight"] = torch.cat([q, q_right], dim=1)   # reads emb (and the state)
    out["layers.0.self_attn.k_proj.weight"] = torch.cat([torch.zeros_like(k), k], dim=1)   # reads state only
    out["layers.0.self_attn.v_proj.weight"] = torch.cat([torch.zeros_like(v), v], dim=1)
    head = model.lm_head.detach().to("cpu", torch.float32)                                  # [V, d]
    if vocab is None:
        out["lm_head.weight"] = head
    else:
        out["lm_head.weight"] = head[torch.tensor(vocab)]                                   # [N, d]
    if embed_tokens:
        out["embed_tokens.weight"] = model.embed_tokens.detach().to("cpu", torch.float32)
    out = {name: t.to(dtype).contiguous() for name, t in out.items()}
    if vocab is not None:
        out["d2t"], out["t2d"] = _vocab_maps(vocab, model.config.vocab_size)
    return out


def eagle3_config(model: nn.Module, target: EngineTarget, vocab: list[int] | None, *, layout: str,
                  speculative_tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    c = model.config
    # vLLM sizes fc from num_aux_hidden_states (else eagle_config's ids, else 3), never from the top-level ids.
    layer = {**_llama_config(c, target, dtype), "num_aux_hidden_states": len(c.key_layers)}
    draft_vocab_size = c.vocab_size if vocab is None else len(vocab)
    if layout == "speculators":
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target.name_or_path, "architectures": list(target.architectures)},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab_size,
            # Our residual is the raw state. vLLM's speculators parser defaults an absent flag to True.
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "target_hidden_size": c.hidden_size,
            # HF hidden_states index i (the stream entering decoder layer i) = vLLM's aux id i.
            "eagle_aux_hidden_state_layer_ids": list(c.key_layers),
            "embed_requires_grad": False, "tie_word_embeddings": False,
        }
    return {  # SGLang / SpecForge: a flat Llama config
        **layer, "architectures": ["LlamaForCausalLMEagle3"], "torch_dtype": layer["dtype"],
        "draft_vocab_size": draft_vocab_size, "target_hidden_size": c.hidden_size, "norm_before_residual": False,
        # SGLang captures id k at the input of decoder layer k + 1: HF hidden_states[k + 1].
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [layer_id - 1 for layer_id in c.key_layers],
                         "use_aux_hidden_state": True},
    }


def check_eagle3(model: nn.Module, target: EngineTarget, layout: str) -> None:
    """Refuse a drafter that is not exactly one EAGLE-3 layer, or that reads layers the engine cannot give."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {list(LAYOUTS)}")
    form_of(model).export_format(LAYOUTS[layout])  # the form can be one EAGLE-3 layer (its registry row)
    layers = list(model.config.key_layers)
    if max(layers) >= target.num_hidden_layers:
        raise ValueError(f"the drafter reads target layers {layers} but the target has {target.num_hidden_layers} "
                         "decoder layers; pass the target it was trained on")
    if layout == "sglang" and len(layers) != SGLANG_AUX_LAYERS:
        recipe = ",".join(map(str, eagle3_aux_layers(target.num_hidden_layers)))
        raise ValueError(f"SGLang's EAGLE-3 drafter (llama_eagle3.py) builds its fc for exactly {SGLANG_AUX_LAYERS} "
                         f"aux layers and this drafter keys on {len(layers)} ({layers}); extract with --layers "
                         f"{recipe},-1 (the default) and train with --residual state, or serve it in vLLM "
                         "with --format eagle3")
    if layout == "sglang" and 0 in layers:
        raise ValueError(f"key layer 0 (the embeddings) of {layers} has no SGLang aux id (SGLang id k is the "
                         "output of decoder layer k); use --format eagle3 (vLLM id 0 is the embeddings)")


def export_eagle3(drafter: str | os.PathLike | nn.Module, target: EngineTarget, out_dir: str | os.PathLike, *,
                  layout: str = "speculators", draft_vocab: Sequence[int] | None = None,
                  embed_tokens: bool = True, speculative_tokens: int = 3,
                  dtype: torch.dtype = torch.float32, replace: bool = False) -> Path:
    """Write an engine-form Beagle as an EAGLE-3 checkpoint: `layout` "speculators" (vLLM, speculators) or
    "sglang" (SGLang, SpecForge). draft_vocab: the token ids it drafts over (default: the drafter folder's
    `draft_vocab`, or a ReducedVocabDrafter's tokens; the target's EOS ids are added). embed_tokens: write
    the target's embedding too. vLLM and SGLang share the target's own when it is absent (or identical), but
    speculators 0.9.0 does not load it reliably: transformers leaves a weight missing from the checkpoint
    uninitialised, not the NaN its `load_verifier_weights` looks for, so the embedding is garbage unless the
    memory happened to hold a NaN (docs/engine-export.md)."""
    model, meta, vocab = _resolve(drafter, target, draft_vocab)
    check_eagle3(model, target, layout)
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens={speculative_tokens} must be >= 1")
    tensors = eagle3_tensors(model, vocab, embed_tokens=embed_tokens, dtype=dtype)
    if layout == "sglang":
        tensors = {name.replace("layers.0.", "midlayer.", 1): t for name, t in tensors.items()}
    config = eagle3_config(model, target, vocab, layout=layout, speculative_tokens=speculative_tokens, dtype=dtype)
    engine_ids = (config["eagle_aux_hidden_state_layer_ids"] if layout == "speculators"
                  else config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return _write(out_dir, tensors, config, replace=replace, provenance=_provenance(
        model, meta, target, format="eagle3" if layout == "speculators" else "eagle3-sglang", vocab=vocab,
        embed_tokens=embed_tokens, engine_layer_ids=engine_ids))


# --------------------------------------------------------------------------------------------- EAGLE

def check_eagle(model: nn.Module, vocab: list[int] | None) -> None:
    """Refuse an EAGLE-2 drafter that vLLM's EAGLE (llama_eagle.py) would compute differently."""
    form_of(model).export_format("eagle")  # the form has vLLM's EAGLE layout (its registry row)
    if model.config.key_layers != (-1,):
        raise ValueError(f"the drafter fuses target layers {list(model.config.key_layers)}; vLLM's EAGLE reads "
                         "only the target's last (post-norm) hidden state")
    bias = model.fc.bias
    if bias is not None and bool(bias.detach().ne(0).any()):
        raise ValueError(f"fc.bias is not zero (max |b| = {bias.detach().abs().max().item():.3g}); vLLM's EAGLE fc "
                         "has no bias (llama_eagle.py), so the engine would drop it and draft differently")
    if vocab is not None:
        raise ValueError(f"the drafter drafts over a {len(vocab)}-token vocabulary; vLLM's EAGLE has no draft "
                         "vocabulary (no d2t) and would draft over all tokens")


def export_eagle(drafter: str | os.PathLike | nn.Module, target: EngineTarget, out_dir: str | os.PathLike, *,
                 draft_vocab: Sequence[int] | None = None, embed_tokens: bool = True,
                 dtype: torch.dtype = torch.float32, replace: bool = False) -> Path:
    """Write the EAGLE-2 baseline in vLLM's `method: "eagle"` layout: fc [d, 2d] over [Emb(t); h] (our fc's
    input order), one Llama decoder layer without input norm, no final norm, the target's own LM head
    (not written: vLLM shares it). embed_tokens: as for `export_eagle3` (vLLM shares an identical one)."""
    model, meta, vocab = _resolve(drafter, target, draft_vocab)
    check_eagle(model, vocab)
    _check_covered(model, EAGLE_NAMES, skipped={"fc.bias"})
    state = model.state_dict()
    tensors = {EAGLE_NAMES[k]: v.detach().to("cpu", dtype).contiguous() for k, v in state.items() if k in EAGLE_NAMES}
    if embed_tokens:
        tensors["embed_tokens.weight"] = model.embed_tokens.detach().to("cpu", dtype).contiguous()
    config = {**_llama_config(model.config, target, dtype), "architectures": ["EagleLlamaForCausalLM"],
              "torch_dtype": str(dtype).removeprefix("torch.")}
    return _write(out_dir, tensors, config, replace=replace, provenance=_provenance(
        model, meta, target, format="eagle", vocab=None, embed_tokens=embed_tokens, engine_layer_ids=None))


# --------------------------------------------------------------------------------------------- native

def export_native(drafter: str | os.PathLike | nn.Module, out_dir: str | os.PathLike, *,
                  metadata: dict[str, Any] | None = None, replace: bool = False) -> Path:
    """This project's own format: a drafter folder copied as it is, or a loaded drafter saved with `metadata`."""
    is_folder = isinstance(drafter, (str, os.PathLike))
    out, staging = _staging(out_dir, replace, drafter if is_folder else None)
    try:
        if is_folder:
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                if not (Path(drafter) / name).is_file():
                    raise ValueError(f"{Path(drafter) / name} not found; point RUN at a run or its drafter/ folder")
            meta = read_drafter_meta(Path(drafter) / CONFIG_NAME)  # a damaged folder is never copied
            read_weights(Path(drafter) / WEIGHTS_NAME, check_only=True, checksum=meta.get(WEIGHTS_ENTRY))
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                atomic.write_bytes(staging / name, (Path(drafter) / name).read_bytes())
        else:
            save_drafter(staging, bare_drafter(drafter)[0], metadata=metadata or {})
        atomic.write_text(staging / PROVENANCE_NAME, json.dumps(
            {"format": "native", "drafter": str(Path(drafter).resolve()) if is_folder else None}, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    atomic.commit_directory(staging, out, replace=True)
    return out


# --------------------------------------------------------------------------------------------- writing

def _provenance(model, meta, target: EngineTarget, *, format: str, vocab, embed_tokens: bool,
                engine_layer_ids) -> dict[str, Any]:
    return {"format": format, "drafter_type": model.drafter_type, "drafter": model.config.to_dict(),
            "key_layers": list(model.config.key_layers), "engine_layer_ids": engine_layer_ids,
            "draft_vocab_size": model.config.vocab_size if vocab is None else len(vocab),
            "embed_tokens_included": embed_tokens, "verifier": target.name_or_path,
            "target": meta.get("target"), "dataset_ids": meta.get("dataset_ids"),
            "train_steps": meta.get("train_steps")}


EXPORT_FILES = frozenset({CONFIG_NAME, WEIGHTS_NAME, PROVENANCE_NAME})  # all an export of ours holds


def check_replaceable(out_dir: str | os.PathLike, replace: bool, source: str | os.PathLike | None = None) -> Path:
    """`out_dir`, resolved, once it is known that writing there deletes nothing that is not ours: it does not
    exist, or (with `replace`) it is an earlier export of ours, its marker `beagle_export.json` beside nothing
    but the files an export writes. The current folder, a folder holding it, and the drafter being exported
    are refused whatever `replace` says (docs/reliability.md, "nothing is deleted that is not ours")."""
    out = Path(out_dir).resolve()
    if atomic.holds_current_folder(out):
        raise ValueError(f"--out {out_dir} is the current folder or holds it; name a new folder, e.g. "
                         f"--out {Path(out_dir) / 'export'}")
    if source is not None and out == Path(source).resolve():
        raise ValueError(f"--out {out_dir} is the drafter being exported; choose another --out")
    if not out.exists():
        return out
    if not replace:
        raise ValueError(f"{out_dir} exists; choose another --out or pass --force to replace an earlier export")
    entries = {entry.name for entry in out.iterdir()} if out.is_dir() else None
    if entries is None or PROVENANCE_NAME not in entries or not entries <= EXPORT_FILES:
        foreign = "it is not a folder" if entries is None else (
            f"no {PROVENANCE_NAME}" if PROVENANCE_NAME not in entries
            else f"it holds files an export does not write: {', '.join(sorted(entries - EXPORT_FILES)[:3])}")
        raise ValueError(f"{out_dir} exists and is not an export of ours ({foreign}); --force replaces only an "
                         "earlier export: choose another --out")
    return out


def _staging(out_dir: str | os.PathLike, replace: bool, source: str | os.PathLike | None = None) -> tuple[Path, Path]:
    out = check_replaceable(out_dir, replace, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.incomplete-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it 0700; the export is a folder like any other
    return out, staging


def _write(out_dir, tensors: dict[str, Tensor], config: dict[str, Any], *, replace: bool,
           provenance: dict[str, Any]) -> Path:
    out, staging = _staging(out_dir, replace)
    try:
        atomic.write_bytes(staging / WEIGHTS_NAME, save(tensors, metadata={"format": "pt"}))
        atomic.write_text(staging / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        atomic.write_text(staging / PROVENANCE_NAME, json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    atomic.commit_directory(staging, out, replace=True)
    log.info("exported %s (%d tensors) to %s", provenance["format"], len(tensors), out)
    return out
