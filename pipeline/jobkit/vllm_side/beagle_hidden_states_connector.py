"""A hidden-states KV connector that works on every device vLLM runs on, the CPU included.

vLLM's `extract_hidden_states` speculative method writes the chosen layers' states of every prompt token
into a cache-only "KV cache" (one head per layer, head size = hidden size); a KV connector hands them out
when the request finishes. vLLM's example connector (`ExampleHiddenStatesConnector`, vLLM 0.32) copies them
to pinned host memory on a CUDA stream, which fails on a CPU ("pin_memory=True requires a CUDA or other
accelerator backend"). This subclass keeps its scheduler side, files and locks as they are (one
`<request>.safetensors` per request holding `hidden_states` [tokens, layers, d] and `token_ids`, its
`.lock` held exclusively until the file is written) and replaces only the device copy: a plain copy to
host memory (synchronous on a GPU: correct, a little slower than the example's overlap), written by the
connector's thread pool to a temporary name and renamed, so a reader never sees half a file.

vLLM loads it by name: kv_transfer_config={"kv_connector": "BeagleHiddenStatesConnector",
"kv_connector_module_path": "beagle_hidden_states_connector", ...}, with this folder on the engine
processes' PYTHONPATH (pipeline/jobkit/vllm_process.py sets it).
"""
from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)


class BeagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's example hidden-states connector, with a device-agnostic copy to the host (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._copied: set[str] = set()  # requests whose states left the cache (its blocks may be freed)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)  # [blocks]
        offsets = torch.arange(self._block_size, dtype=torch.long)  # [block_size]
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()  # [blocks * block_size]
        num_tokens = int(pending.token_ids.shape[0])
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)  # [T, layers, d]
        states = states.to("cpu", copy=True).contiguous()  # our own copy: the blocks are freed next
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(self._write_atomically, tensors, pending.filename, lock_fd)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))  # logs a failed write
        self._copied.add(pending.req_id)

    @staticmethod
    def _write_atomically(tensors: dict[str, torch.Tensor], filename: str, lock_fd: int | None) -> None:
        temporary = f"{filename}.writing"
        try:
            save_file(tensors, temporary)
            os.replace(temporary, filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on the lock reads the whole file

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy out the states of the requests that finished; report each as sent once copied (never before:
        its blocks are freed then). Only TP rank 0 copies (`get_finished_count` is 1)."""
        if not self._is_tp_rank_zero:
            return None, None
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = self._accumulated_finished_req_ids & self._copied
        self._accumulated_finished_req_ids -= done
        self._copied -= done
        return done or None, None
