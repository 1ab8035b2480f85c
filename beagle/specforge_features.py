"""SpecForge's offline EAGLE-3 samples from a feature store: `export-features --format specforge`.

SpecForge (github.com/sgl-project/SpecForge, read at commit a6b6b02 of 2026-08-08; its reader is the same in
PyPI's specforge 0.2.0) trains EAGLE-3 offline from a folder of `.ckpt` files that its
`scripts/prepare_hidden_states.py` writes by running the target in SGLang. This writes the same files from our
store, without the target:

    DIR/rows_0-2000/data_0.ckpt ... data_1999.ckpt    one torch.save'd dict per sample, 2000 to a folder
    DIR/rows_2000-4000/data_2000.ckpt ...             (its generator's default --file-group-size)
        input_ids         [L] int64
        loss_mask         [L] int64
        aux_hidden_state  [1, L, 3d]   the three aux layers, concatenated in layer order (the store's dtype)
        hidden_state      [1, L, d]    the state the LM head reads, after the final norm
    DIR/specforge_eagle3.json   a run config for `specforge train --config` (target, this folder, layer ids)
    DIR/beagle_features.json    what was written from which store (the marker --force looks for)

How SpecForge reads it decides the rest. `runtime/data_plane/offline_reader.py` lists every `*.ckpt` /
`*.ckpt.gz` under `data.hidden_states_path` (sorted, any depth); `feature_store.load_feature_file` opens each
with torch's loader (memory-mapped, its `weights_only` check off: SpecForge's side, never ours); `algorithms/eagle3/data.py` feeds `aux_hidden_state`
to the draft and `hidden_state` to the teacher, `TargetHead` = the target's LM head alone, so `hidden_state`
is the state *after* the final norm (what SGLang's logits processor receives): our layer -1, bit for bit (no
norm inversion, unlike speculators' format). SGLang captures aux id k (SpecForge's
`model.aux_hidden_state_layer_ids`, the draft config's `eagle_aux_hidden_state_layer_ids`) as the residual
stream entering decoder layer k + 1, i.e. HF `hidden_states[k + 1]`, our store layer k + 1; so the ids are the
store's aux layers minus one, and its default `[1, n//2 - 1, n - 4]` is our default `2, n//2, n - 3`. EAGLE-3
there reads exactly three aux layers (its config refuses other counts), and store layer 0 (the embeddings)
has no id. Its generator writes batch-padded rows (zeros, loss mask 0); we write each sample at its own
length, which its reader takes as is. It skips a sample holding NaN (no file); so do we. Its generator also
writes `vocab_mapping/vocab_mapping.pt`, which needs the draft's vocabulary size; without one SpecForge counts
the loss-masked tokens of these files itself (`model.vocab_mapping_path` empty), so none is written here.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from beagle.feature_export import (FeatureExport, aux_layers_of, check_replaceable, finish_export,
                                   sample_dtype, save_atomically, staging_for, write_samples)
from pipeline.store.atomic import write_text

log = logging.getLogger(__name__)

FILE_GROUP_SIZE = 2000
RUN_CONFIG = "specforge_eagle3.json"
AUX_LAYERS = 3


def sample_path(index: int, group_size: int = FILE_GROUP_SIZE) -> str:
    """Where SpecForge's generator puts sample `index`: `rows_<g>-<g + size>/data_<index>.ckpt`."""
    group = index // group_size * group_size
    return f"rows_{group}-{group + group_size}/data_{index}.ckpt"


def specforge_layer_ids(layers: list[int], num_hidden_layers: int | None) -> tuple[list[int], int]:
    """(SpecForge's three aux layer ids, the index of layer -1 in `layers`) for a store's `layers`; a one-line
    ValueError naming the `extract --layers` to use when the store cannot feed SpecForge's EAGLE-3."""
    from beagle.layer_capture import eagle3_aux_layers

    aux, last = aux_layers_of(layers)
    if len(aux) == AUX_LAYERS and min(aux) >= 1:
        return [layer - 1 for layer in sorted(aux)], last
    fix = (f"extract --layers {' '.join(map(str, eagle3_aux_layers(num_hidden_layers)))} -1"
           if num_hidden_layers else "extract with the default --layers")
    raise ValueError(f"the store holds aux layers {aux}; SpecForge's EAGLE-3 reads exactly three, none of them "
                     f"the embeddings (layer 0): re-extract with `{fix}`")


def run_config(target: Path, out: Path, layer_ids: list[int], max_length: int) -> dict:
    """The smallest `specforge train --config` that trains EAGLE-3 on `out`: dotted overrides
    (`output_dir=...`, `training.num_epochs=...`) on the command line set the rest."""
    return {"model": {"target_model_path": str(target), "aux_hidden_state_layer_ids": layer_ids},
            "data": {"hidden_states_path": str(out), "max_length": max_length},
            "training": {"strategy": "eagle3"}}


def export_specforge(store_url: str, out: str | os.PathLike, *, target: str | os.PathLike, force: bool = False,
                     progress: Callable[[int], None] | None = None) -> FeatureExport:
    """Write the store at `store_url` as SpecForge's offline EAGLE-3 samples at `out` (module docstring).

    `target`: the target's folder, named in the run config; `progress` is called with 1 per sample. The caller
    has verified the store's checksums and that `target` is the store's."""
    from beagle.torch_store import open_store

    out = Path(out).resolve()
    check_replaceable(out, force)
    store = open_store(store_url)
    layers = store.layers
    architecture = (store.target or {}).get("architecture") or {}
    layer_ids, last = specforge_layer_ids(layers, architecture.get("num_hidden_layers"))
    aux_index = [layers.index(layer_id + 1) for layer_id in layer_ids]
    staging, resumed = staging_for(out, store.dataset_id, "rows_*/data_*.ckpt")

    def write(index: int, input_ids: np.ndarray, loss_mask: np.ndarray, states: torch.Tensor, path: Path) -> bool:
        dtype = sample_dtype(states)
        # Fresh tensors (cat, clone): torch.save writes a tensor's whole storage, and a slice of the store's
        # memory map would carry its whole shard.
        aux = torch.cat([states[i].to(dtype) for i in aux_index], dim=-1).unsqueeze(0)      # [1, L, 3d]
        record = {"input_ids": torch.from_numpy(input_ids.copy()),                           # [L] int64
                  "loss_mask": torch.from_numpy(loss_mask.astype(np.int64)),                 # [L] int64
                  "aux_hidden_state": aux,
                  "hidden_state": states[last].to(dtype).clone().unsqueeze(0)}               # [1, L, d]
        if any(bool(torch.isnan(record[key]).any()) for key in ("aux_hidden_state", "hidden_state")):
            log.warning("sample %d holds NaN: left out, as SpecForge's generator leaves such a sample", index)
            return False
        path.parent.mkdir(exist_ok=True)
        save_atomically(path, lambda temporary: torch.save(record, temporary))
        return True

    tokens, skipped = write_samples(store, staging, sample_path, write, progress=progress)
    max_length = max((int(length) for length in store.lengths), default=1)
    config = run_config(Path(target).resolve(), out, layer_ids, max_length)
    write_text(staging / RUN_CONFIG, json.dumps(config, indent=2) + "\n")
    finish_export(staging, out, {
        "format": "specforge", "store": store_url, "dataset_id": store.dataset_id, "layers": layers,
        "target_layer_ids": layer_ids, "samples": len(store) - skipped, "skipped": skipped, "tokens": tokens,
        "file_group_size": FILE_GROUP_SIZE,
        "aux_hidden_state": "store layers target_layer_ids + 1 (SpecForge's id k = HF hidden_states[k + 1]), "
                            "concatenated in that order on the last axis",
        "hidden_state": "store layer -1, after the final norm (SpecForge's teacher is the LM head alone)",
        "target": store.manifest.get("target", {})})
    log.info("wrote %d samples (%d tokens, %d left out) for SpecForge to %s", len(store) - skipped, tokens,
             skipped, out)
    return FeatureExport(out=out, samples=len(store) - skipped, tokens=tokens, target_layer_ids=tuple(layer_ids),
                         resumed=resumed, skipped=skipped, config=out / RUN_CONFIG)
