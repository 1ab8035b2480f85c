"""The target forward: hidden states of whole samples, batched by a token budget without padding leaks.

Layer semantics (`layers`, HF `hidden_states` indices): 0 is the embedding output, k (1..n) the output
of decoder layer k, and -1 the state the LM head reads, i.e. the base model's `last_hidden_state`, which
is after the final norm (for Llama/Qwen2/GPT-2 this is also `hidden_states[-1]` == `hidden_states[n]`).
We call the base model (`model.model` for Llama) rather than the CausalLM: it skips the LM head and the
[B, L, V] logits (+23% tokens/s in bf16 on CPU, see environment notes).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from beagle.devices import pick_device
from beagle.layer_capture import LayerCapture, base_model, normalize_layers
from beagle.target_facts import facts_from_config
from beagle.target_model import TargetSpec
from pipeline.jobkit.vllm_process import VllmConfig

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ForwardConfig:
    model_path: str
    layers: tuple[int, ...] = (-1,)
    dtype: str = "bfloat16"
    batch_tokens: int = 16384  # padded tokens per forward batch (rows x longest row)
    device: str | None = None  # None: cuda when available, else cpu
    threads: int | None = None  # torch CPU threads; None leaves torch's default
    trust_remote_code: bool = False
    device_map: str | None = None  # "auto": spread layers over every GPU the actor sees (targets > 1 GPU)
    engine: str = "hf"  # "vllm": the states from vLLM (pipeline/extract/vllm_forward.py)
    vllm: VllmConfig = VllmConfig()  # --engine vllm: its environment and how one engine spreads
    max_length: int = 2048  # --engine vllm: the longest sample, vLLM's max_model_len less the one token sampled

    @property
    def target(self) -> TargetSpec:
        """How the actor opens the target: the one `TargetSpec` every command uses."""
        return TargetSpec(self.model_path, self.dtype, self.trust_remote_code, self.device_map)


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample positions into batches whose padded size (rows x longest) fits `batch_tokens`.

    Longest first, ties by position, so the plan depends only on the lengths: the same shard always gets
    the same batches, and a resumed run stores the same bytes. A sample longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for position in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(position)
        else:
            batches.append([position])
    return batches


def states_to_host(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """The captured layers' states (n_layers x [B, L, d], each on its own device) as one host tensor
    [B, n_layers, L, d], each layer copied once, straight into its place.

    On CUDA the copies go into pinned memory without blocking (PyTorch caches pinned blocks, so batches
    reuse them) and the host waits once per device after every layer is queued: the states leave at the
    link's full rate and the device is not stopped once per layer. On the CPU one layer stays a view.
    """
    first = states[0]
    if len(states) == 1 and first.device.type == "cpu":
        return first.unsqueeze(1)  # a view, no copy
    devices = {state.device for state in states if state.device.type == "cuda"}
    pinned = bool(devices)
    host = torch.empty(first.shape[0], len(states), *first.shape[1:], dtype=first.dtype, pin_memory=pinned)
    for index, state in enumerate(states):
        host[:, index].copy_(state, non_blocking=pinned)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()  # the host reads `host` next (hash, write)
    return host


class TargetForward:
    """Loads the target once and returns per-sample hidden states [n_layers, L, d] in the store dtype."""

    def __init__(self, config: ForwardConfig) -> None:
        from transformers import AutoModelForCausalLM

        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.device = pick_device(config.device)
        # One device per actor (`.to`); with --device-map, consecutive layers spread over the actor's GPUs
        # (accelerate): inputs then go to the device of the embedding and the states come back from
        # wherever the last layer ran.
        model = config.target.load_model(self.device)
        if config.device_map:
            self.device = model.get_input_embeddings().weight.device
        self.model = model
        self.base = base_model(model)
        facts = facts_from_config(model.config, where=f"--model {config.model_path}")
        self.num_layers, self.hidden_size = facts.num_hidden_layers, facts.hidden_size
        self.layers = normalize_layers(config.layers, self.num_layers)
        logger.info("loaded %s on %s (%s), capturing layers %s", config.model_path, self.device,
                    config.dtype, self.layers)

    def head(self) -> dict[str, torch.Tensor]:
        """The frozen embedding and LM head weights ([V, d] each) the drafter reuses."""
        embed = self.model.get_input_embeddings().weight.detach().cpu()
        lm_head = self.model.get_output_embeddings().weight.detach().cpu()
        if lm_head.data_ptr() == embed.data_ptr():  # tied (SmolLM2 and most small models): two tensors on disk
            lm_head = lm_head.clone()
        return {"embed_tokens": embed, "lm_head": lm_head}

    @torch.inference_mode()
    def forward_batch(self, sequences: list[np.ndarray]) -> list[torch.Tensor | None]:
        """One padded forward over `sequences`; returns [n_layers, L_i, d] per sequence, or None for a
        sequence whose states hold an inf or NaN in any captured layer (a target that overflows in its
        dtype, typically float16): such states must never reach a store, and the caller rejects the record.

        Right padding with an attention mask: a real token only attends to earlier real tokens (causal),
        and the padded tail is cut off, so padding never reaches a stored state.
        """
        longest = max(len(s) for s in sequences)
        input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros(len(sequences), longest, dtype=torch.long)  # [B, L]
        for row, sequence in enumerate(sequences):
            input_ids[row, :len(sequence)] = torch.as_tensor(np.asarray(sequence, dtype=np.int64))
            attention_mask[row, :len(sequence)] = 1
        # Hooks keep only the wanted layers' states (not all n+1 of output_hidden_states); each leaves its
        # device on its own (with --device-map they sit on different GPUs) and is stacked on the host.
        with LayerCapture(self.base, self.layers) as capture:
            output = self.base(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                               output_hidden_states=capture.output_hidden_states, use_cache=False)
        states = capture.states(output)  # n_layers x [B, L, d]
        # One reduction per layer over the whole padded batch, queued on its device before the copy and read
        # after it (states_to_host waits for the device anyway): no wait of its own, no sync per token.
        finite = [torch.isfinite(state).all() for state in states]
        stacked = states_to_host(states)  # [B, n_layers, L, d]
        del output, capture, states
        # Per-sample slices stay views of the batch until the shard is written.
        rows = [stacked[row, :, :len(sequence)] for row, sequence in enumerate(sequences)]
        if all(bool(flag) for flag in finite):
            return rows
        # Rare: look at each sample alone, its real tokens only (a padded tail may overflow where it does not).
        return [row if bool(torch.isfinite(row).all()) else None for row in rows]

    def hidden_states(self, sequences: list[np.ndarray]) -> list[torch.Tensor | None]:
        """Hidden states of every sequence, in input order, batched by `config.batch_tokens` (None where
        they are not finite, as `forward_batch` says)."""
        result: list[torch.Tensor | None] = [None] * len(sequences)
        for batch in plan_batches([len(s) for s in sequences], self.config.batch_tokens):
            for position, states in zip(batch, self.forward_batch([sequences[i] for i in batch])):
                result[position] = states
        return result
