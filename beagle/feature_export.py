"""One store, any trainer: a feature store written as the offline samples another trainer reads.

`export-features --format speculators` (pipeline/commands/export_features.py) writes what speculators'
trainer (`python -m speculators.train`, 0.9) reads with `--data-path DIR`, so a team can train its EAGLE-3
drafter from a store we made, without running the target again:

    DIR/                                  a `datasets` folder (`load_from_disk(DIR)`, torch format):
      data-*.arrow, state.json, ...       input_ids [L] int64, loss_mask [L] int64, seq_len, one row per sample
      hidden_states/hs_<i>.safetensors    hidden_states [L, n_aux + 1, d] (bf16), token_ids [L] int64
      token_freq.pt                       {token id: count} over the loss-masked tokens (draft vocabulary)
      beagle_features.json                what was written from which store (and the marker that it is ours)

Two facts of speculators' format decide the conversion (read in its `train/data.py` and
`models/eagle3/core.py`): `hidden_states[:, :-1]` are the aux layers, flattened in order to [L, n_aux * d],
and `hidden_states[:, -1]` is the verifier's last state *before* its final norm: the trainer's teacher is
`lm_head(norm(last))`. Our store keeps layer -1 *after* the norm (the state the LM head reads, docs/extract.md),
and applying the norm twice would give speculators a wrong teacher. For a norm that is a per-channel gain
of x / rms(x) (RMSNorm and its kin), `y / gain` is a state the norm maps back to `y` (the norm does not see
its input's scale), so that is what we write, checked on the first sample; a norm for which the check fails
(LayerNorm's mean and bias) is refused in one line.

The output appears whole or not at all: samples go into a staging folder beside `--out` (each file written
under a temporary name and renamed, so a crash leaves whole files only); a rerun against the same store
resumes from the files there; the finished folder is renamed into place. Those pieces (`staging_for`,
`save_atomically`, `write_samples`, `finish_export`, `check_replaceable`) are every format's:
`--format specforge` (beagle/specforge_features.py) writes SpecForge's `.ckpt` samples with them.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.store.atomic import commit_directory, holds_current_folder, write_text

log = logging.getLogger(__name__)

MARKER = "beagle_features.json"
PARTIAL_MARKER = "beagle_features.partial.json"
HIDDEN_DIR = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
# The relative error `norm(y / gain)` may have against `y` and still be `y` (bf16 rounding is 2^-8 = 0.4%).
NORM_INVERSE_TOLERANCE = 2e-2


@dataclass(frozen=True)
class FeatureExport:
    """What an export wrote: `samples` samples of `tokens` tokens, `target_layer_ids` (the aux layers as the
    trainer numbers them: speculators' `--target-layer-ids`, SpecForge's `aux_hidden_state_layer_ids`),
    `resumed` of them kept from an interrupted run, `skipped` left out (SpecForge's reader never sees a sample
    holding NaN), `config` the trainer's run config when the format has one."""

    out: Path
    samples: int
    tokens: int
    target_layer_ids: tuple[int, ...]
    resumed: int
    skipped: int = 0
    config: Path | None = None


def aux_layers_of(layers: list[int]) -> tuple[list[int], int]:
    """(the aux layers in store order, the index of layer -1) of a store's `layers`; a one-line ValueError
    when the store cannot feed an EAGLE-3 trainer (no -1, or nothing else)."""
    if -1 not in layers:
        raise ValueError(f"the store holds layers {layers} without -1 (the state the LM head reads), which "
                         "an EAGLE-3 trainer's teacher needs; re-extract with the default --layers")
    aux = [layer for layer in layers if layer != -1]
    if not aux:
        raise ValueError("the store holds only layer -1; an EAGLE-3 trainer needs aux layers too: re-extract "
                         "with the default --layers (EAGLE-3's three aux layers and -1)")
    return aux, layers.index(-1)


def norm_gain(norm: torch.nn.Module, hidden_size: int) -> torch.Tensor:
    """The per-channel gain [d] of a final norm: what it makes of a vector of ones (rms 1)."""
    with torch.no_grad():
        return norm(torch.ones(1, 1, hidden_size)).reshape(hidden_size).float()


def pre_norm_state(after_norm: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """[L, d] float32: a state the final norm maps to `after_norm` [L, d] (see the module docstring)."""
    return after_norm.float() / gain


def check_norm_inverse(norm: torch.nn.Module, after_norm: torch.Tensor, gain: torch.Tensor,
                       dtype: torch.dtype) -> float:
    """The relative error of `norm(pre_norm_state(y))`, as written in `dtype`, against y [L, d]; a one-line
    ValueError when it is not y (a norm that is not a per-channel gain of x / rms(x))."""
    if bool((gain == 0).any()) or not bool(torch.isfinite(gain).all()):
        raise ValueError(f"the target's final norm ({type(norm).__name__}) has zero or non-finite gains; its "
                         "input cannot be recovered from the stored state after it, so speculators' format "
                         "cannot be written from this store")
    with torch.no_grad():
        back = norm(pre_norm_state(after_norm, gain).to(dtype).float().unsqueeze(0)).squeeze(0)
    y = after_norm.float()
    error = float((back - y).norm() / y.norm().clamp_min(1e-12))
    if not error <= NORM_INVERSE_TOLERANCE:
        raise ValueError(f"the target's final norm ({type(norm).__name__}) is not a per-channel gain of "
                         f"x / rms(x) (re-normalising the stored state is off by {error:.1%}); speculators' "
                         "format needs the state before it, which this store does not hold")
    return error


def sample_dtype(states: torch.Tensor) -> torch.dtype:
    """The dtype a sample's states are written in: the store's, when a trainer reads it (bf16, fp32), else bf16
    (a float8 or int8 store decodes to float32, twice the bytes of what the target computed in)."""
    return states.dtype if states.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16


def save_atomically(path: Path, save: Callable[[Path], None]) -> None:
    """`save(temporary)` under a temporary name beside `path`, then renamed: a file at `path` is always whole.
    The temporary name starts with '.' and ends in `.tmp-<pid>`, so no trainer's suffix matches it."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save(temporary)
    os.replace(temporary, path)


def staging_for(out: Path, dataset_id: str, sample_glob: str) -> tuple[Path, int]:
    """The staging folder beside `out` and how many sample files (`sample_glob`, relative to it) an earlier run
    against the same store left there; a killed run's temporary files are deleted. A staging folder of ours
    for another store (its marker names another dataset_id) is deleted and begun again; one without our
    marker is refused, never reused or deleted."""
    staging = out.with_name(f".{out.name}.incomplete")
    marker = staging / PARTIAL_MARKER
    if staging.exists():
        if not marker.is_file():
            raise FileExistsError(f"{staging} exists and is not a partial export of ours (no {PARTIAL_MARKER}); "
                                  "move it away or choose another --out")
        earlier = json.loads(marker.read_text(encoding="utf-8"))
        if earlier.get("dataset_id") != dataset_id:
            shutil.rmtree(staging)  # ours (its marker says so), of another store: useless for this one
        else:
            for leftover in staging.rglob(".*.tmp-*"):
                leftover.unlink()
            return staging, len(list(staging.glob(sample_glob)))
    staging.mkdir(parents=True)
    write_text(marker, json.dumps({"dataset_id": dataset_id}) + "\n")
    return staging, 0


SampleWriter = Callable[[int, np.ndarray, np.ndarray, torch.Tensor, Path], bool]


def write_samples(store: Any, staging: Path, path_of: Callable[[int], str], write: SampleWriter, *,
                  progress: Callable[[int], None] | None = None,
                  on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None) -> tuple[int, int]:
    """Write each sample of `store` whose file `staging / path_of(i)` is missing, one sample in memory at a
    time: `write(i, input_ids [L] int64, loss_mask [L] bool, hidden_states [n_layers, L, d], path)` returns
    False for a sample it leaves out. Every sample's tokens are read (cheap), and handed to `on_tokens`; the
    states only of samples to write, so a resumed run reads what is left. Returns (tokens, samples left out)."""
    tokens = skipped = 0
    for index in range(len(store)):
        input_ids, loss_mask = store.get_tokens(index)                            # [L], [L]
        input_ids, loss_mask = np.asarray(input_ids, np.int64), np.asarray(loss_mask).astype(bool)
        if on_tokens:
            on_tokens(input_ids, loss_mask)
        tokens += int(input_ids.shape[0])
        path = staging / path_of(index)
        if not path.is_file() and not write(index, input_ids, loss_mask, store[index]["hidden_states"], path):
            skipped += 1
        if progress:
            progress(1)
    return tokens, skipped


def finish_export(staging: Path, out: Path, summary: dict[str, Any]) -> None:
    """Mark the staging folder a whole export (`summary` in MARKER, what --force looks for) and rename it to
    `out`, replacing an earlier export there (`check_replaceable` allowed it)."""
    (staging / PARTIAL_MARKER).unlink()
    write_text(staging / MARKER, json.dumps(summary, indent=2) + "\n")
    commit_directory(staging, out, replace=True)


def check_replaceable(out: Path, force: bool) -> None:
    """`out` may be written: it does not exist, or it is an export of ours and `force` says replace it (never
    the current folder or one holding it)."""
    if holds_current_folder(out):
        raise FileExistsError(f"--out {out} is the current folder or holds it; name a new folder")
    if not out.exists():
        return
    if not force:
        raise FileExistsError(f"{out} exists; pass --force to replace an earlier export-features output")
    if not (out / MARKER).is_file():
        raise FileExistsError(f"{out} exists and is not an export-features output (no {MARKER}); --force "
                              "replaces only our own exports: choose another --out")


def export_speculators(store_url: str, out: str | os.PathLike, *, final_norm: torch.nn.Module,
                       force: bool = False, progress: Callable[[int], None] | None = None,
                       dataset_progress: bool = False) -> FeatureExport:
    """Write the store at `store_url` as speculators' offline training data at `out` (module docstring).

    `final_norm`: the target's final norm (`beagle.target_model.read_final_norm`); `progress` is called with
    1 per sample written. The caller has verified the store's checksums."""
    from beagle.torch_store import open_store

    out = Path(out).resolve()
    check_replaceable(out, force)
    store = open_store(store_url)
    layers = store.layers
    aux, last = aux_layers_of(layers)
    aux_index = [layers.index(layer) for layer in aux]
    vocab_size = store.vocab_size or int(store.load_head()["lm_head"].shape[0])
    gain = norm_gain(final_norm, store.hidden_size)
    if len(store):  # checked on the first sample, before anything is written
        first = store[0]["hidden_states"]                                         # [n_layers, L, d]
        check_norm_inverse(final_norm, first[last], gain, sample_dtype(first))
        del first
    staging, resumed = staging_for(out, store.dataset_id, f"{HIDDEN_DIR}/hs_*.safetensors")
    (staging / HIDDEN_DIR).mkdir(exist_ok=True)
    counts = np.zeros(vocab_size, dtype=np.int64)

    def count(input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        np.add.at(counts, input_ids[loss_mask], 1)

    def write(index: int, input_ids: np.ndarray, loss_mask: np.ndarray, states: torch.Tensor, path: Path) -> bool:
        from safetensors.torch import save_file

        dtype = sample_dtype(states)
        last_state = pre_norm_state(states[last], gain).to(dtype)                 # [L, d]
        stacked = torch.stack([*(states[i].to(dtype) for i in aux_index), last_state], dim=1)  # [L, n_aux + 1, d]
        tensors = {"hidden_states": stacked.contiguous(), "token_ids": torch.from_numpy(input_ids)}
        save_atomically(path, lambda temporary: save_file(tensors, str(temporary)))
        return True

    tokens, _ = write_samples(store, staging, lambda index: f"{HIDDEN_DIR}/hs_{index}.safetensors", write,
                              progress=progress, on_tokens=count)
    _write_dataset(store, staging, dataset_progress)
    torch.save({int(token): int(count) for token, count in enumerate(counts) if count}, staging / TOKEN_FREQ)
    finish_export(staging, out, {
        "format": "speculators", "store": store_url, "dataset_id": store.dataset_id, "layers": layers,
        "target_layer_ids": aux, "samples": len(store), "tokens": tokens,
        "hidden_states": "aux layers in target_layer_ids order, then the last layer's state before the final "
                         "norm (stored state after it / the norm's per-channel gain)",
        "target": store.manifest.get("target", {})})
    log.info("wrote %d samples (%d tokens) for speculators to %s", len(store), tokens, out)
    return FeatureExport(out=out, samples=len(store), tokens=tokens, target_layer_ids=tuple(aux),
                         resumed=resumed)


def _write_dataset(store: Any, staging: Path, show_progress: bool) -> None:
    """The `datasets` folder (input_ids, loss_mask, seq_len per sample, torch format), streamed from the
    store through a generator so its memory is one sample; the build cache lives in the staging folder."""
    import datasets
    from datasets import Features, Sequence, Value

    if not show_progress:
        datasets.disable_progress_bars()

    def rows():
        for index in range(len(store)):
            input_ids, loss_mask = store.get_tokens(index)                        # [L], [L]
            input_ids, loss_mask = np.asarray(input_ids, np.int64), np.asarray(loss_mask, np.int64)
            yield {"input_ids": input_ids, "loss_mask": loss_mask, "seq_len": int(input_ids.shape[0])}

    features = Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                         "seq_len": Value("int64")})
    cache = staging / ".datasets-cache"
    table = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(cache))
    table.set_format("torch")
    table.save_to_disk(str(staging))
    del table
    shutil.rmtree(cache, ignore_errors=True)
