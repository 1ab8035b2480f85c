"""`extract --engine vllm`: the target's hidden states from vLLM, in the shape our store writer takes.

`VllmForward` stands where `TargetForward` (transformers) stands in the forward actor: `hidden_states` of
a shard's samples, `head`, `layers`, `hidden_size`. It runs one vLLM worker process
(pipeline/jobkit/vllm_process.py) in its hidden-states mode: vLLM's own `extract_hidden_states`
speculative method keeps the states of the chosen aux layers for every prompt token, and our KV connector
(pipeline/jobkit/vllm_side/beagle_hidden_states_connector.py) writes each prompt's states to a safetensors
file in a scratch folder of this actor's, which is read here, checked and deleted.

Layer numbers: vLLM's aux layer i is the residual stream entering decoder layer i (hidden + residual), the
same state as our (HF `hidden_states`) layer i for 0 <= i < n. Our -1 is the state the LM head reads, after
the final norm; vLLM hands out layer n (the last layer's output, before the norm), and the final norm is
applied here, in the target's dtype, with the target's own norm module (beagle.target_model.read_final_norm).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from beagle.devices import torch_dtype
from beagle.target_facts import read_target_facts
from beagle.target_model import read_final_norm, read_head_weights
from pipeline.jobkit.vllm_process import VllmConfig, VllmEngineError, VllmWorkerProcess

if TYPE_CHECKING:
    from pipeline.extract.forward import ForwardConfig

logger = logging.getLogger(__name__)

# Prompts vLLM keeps in flight at once (its scheduler's max_num_seqs); --batch-tokens is its token budget a step.
MAX_NUM_SEQS = 256


def vllm_layer_ids(layers: Sequence[int], num_layers: int) -> list[int]:
    """vLLM's aux layer ids for our canonical `layers` (-1 or 0..n-1), ascending: the order vLLM stacks
    them in (its forward appends each as it passes the layer, whatever order it was given)."""
    return sorted({num_layers if layer == -1 else layer for layer in layers})


SCRATCH_PREFIX = "beagle-vllm-states-"
SCRATCH_FILES = (".safetensors", ".lock", ".writing")  # all the worker writes into its scratch folder


def scratch_root() -> str:
    """Where the worker's states files go: the shared-memory file system when there is one (the files are
    read once, right away), else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def make_scratch(root: str) -> Path:
    """A new scratch folder `beagle-vllm-states-<pid>-*` under `root`, after removing those left by actors
    that died without closing (Ray kills an actor and its worker at once, and /dev/shm is memory). A folder
    is removed only when it is provably one of ours: our prefix, owned by this user, its pid gone, and
    holding nothing but the worker's own files."""
    for folder in Path(root).glob(SCRATCH_PREFIX + "*"):
        try:
            owner_pid = int(folder.name[len(SCRATCH_PREFIX):].split("-")[0])
            if folder.stat().st_uid != os.getuid() or _alive(owner_pid):
                continue
            if all(item.is_file() and item.name.endswith(SCRATCH_FILES) for item in folder.iterdir()):
                shutil.rmtree(folder)
                logger.info("removed %s, left by vLLM states of a process that is gone", folder)
        except (ValueError, OSError):
            continue  # not named as ours, or gone meanwhile: not ours to touch
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VllmForward:
    """One vLLM worker for a forward actor; returns per-sample hidden states [n_layers, L, d] in the store
    dtype, as `TargetForward` does (None for a sample whose states are not finite)."""

    def __init__(self, config: "ForwardConfig", *, log_dir: str | None = None) -> None:
        self.config = config
        facts = read_target_facts(config.model_path, trust_remote_code=config.trust_remote_code)
        self.num_layers, self.hidden_size = facts.num_hidden_layers, facts.hidden_size
        from beagle.layer_capture import normalize_layers

        self.layers = normalize_layers(config.layers, self.num_layers)
        self.aux_ids = vllm_layer_ids(self.layers, self.num_layers)
        self.dtype = torch_dtype(config.dtype)
        # the final norm, for layer -1 (see the module docstring): two small tensors from the weight files
        self.final_norm = (read_final_norm(config.model_path, config.trust_remote_code).to(self.dtype)
                           if -1 in self.layers else None)
        self.scratch = make_scratch(scratch_root())
        settings: VllmConfig = config.vllm
        # --batch-tokens is vLLM's token budget a step; at least one whole sample, so none is split over steps
        step_tokens = max(config.batch_tokens, config.max_length + 1)
        arguments = ["--dtype", config.dtype, "--max-model-len", str(config.max_length + 1),
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(step_tokens),
                     "--seed", "0", "--hidden-states", ",".join(map(str, self.aux_ids)), "--scratch", str(self.scratch)]
        try:
            self.worker = VllmWorkerProcess(settings, config.model_path, arguments,
                                            trust_remote_code=config.trust_remote_code, log_dir=log_dir)
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        self.version = self.worker.version
        logger.info("vLLM %s gives aux layers %s for layers %s", self.version, self.aux_ids, self.layers)

    def head(self) -> dict[str, torch.Tensor]:
        """The frozen embedding and LM head ([V, d] each), read from the weight files (vLLM keeps its own)."""
        head = read_head_weights(self.config.model_path, self.config.dtype,
                                 trust_remote_code=self.config.trust_remote_code)
        if head is None:
            raise VllmEngineError(f"--model {self.config.model_path}: its embedding and LM head are not found by "
                                  "name in its safetensors files, which --engine vllm reads them from; use --engine hf")
        return head

    @torch.inference_mode()
    def hidden_states(self, sequences: list[np.ndarray]) -> list[torch.Tensor | None]:
        """Hidden states of every sequence, in input order: the whole shard to vLLM at once (it batches
        them itself, `max_num_seqs` in flight), each prompt's file read back and deleted."""
        prompts = [np.asarray(s, dtype=np.int64).tolist() for s in sequences]
        files = self.worker.ask({"prefill": prompts}, "files", "prefilling")
        return [self._read(Path(path), prompt) for path, prompt in zip(files, prompts)]

    def _read(self, path: Path, prompt: list[int]) -> torch.Tensor | None:
        from safetensors.torch import load_file

        if path.parent != self.scratch:  # only files of our own scratch folder are read and deleted
            raise VllmEngineError(f"the vLLM worker wrote {path}, outside {self.scratch}")
        tensors = load_file(str(path))
        path.unlink()
        if tensors["token_ids"].tolist() != prompt:
            raise VllmEngineError(f"{path.name}: vLLM's states are of other tokens than the prompt sent")
        states = tensors["hidden_states"].to(self.dtype)  # [L, n_aux, d]
        if states.shape[1:] != (len(self.aux_ids), self.hidden_size):
            raise VllmEngineError(f"{path.name}: vLLM gave states of shape {tuple(states.shape)}, not "
                                  f"[{len(prompt)}, {len(self.aux_ids)}, {self.hidden_size}]")
        rows = []
        for layer in self.layers:  # [L, d] each, in the order asked
            state = states[:, self.aux_ids.index(self.num_layers if layer == -1 else layer)]
            rows.append(self.final_norm(state) if layer == -1 else state)
        stacked = torch.stack(rows)  # [n_layers, L, d]
        return stacked if bool(torch.isfinite(stacked).all()) else None

    def close(self) -> None:
        self.worker.close()
        shutil.rmtree(self.scratch, ignore_errors=True)  # our own folder (mkdtemp): its leftovers are ours

    def __del__(self) -> None:
        scratch = getattr(self, "scratch", None)
        if scratch is not None and scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
