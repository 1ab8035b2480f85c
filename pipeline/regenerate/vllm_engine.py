"""`regenerate --engine vllm`: each generation actor's vLLM worker process, token ids in, token ids out.

The worker process, its environment and its settings are the job kit's (pipeline/jobkit/vllm_process.py,
shared with `extract --engine vllm`); this module says what generation asks of it. Rendering, the
prompt-length rule, rejects, EOS and decoding stay in `pipeline/regenerate/generation.py`, shared with the
transformers engine, so both write the same file.
"""
from __future__ import annotations

from typing import Any

from pipeline.jobkit.vllm_process import (CHECKOUT_VENV, EXECUTORS, VllmConfig, VllmEngineError, VllmWorkerProcess,
                                          probe_vllm, resolve_executor, vllm_python, worker_env)

__all__ = ["CHECKOUT_VENV", "EXECUTORS", "VllmConfig", "VllmEngine", "VllmEngineError", "probe_vllm",
           "resolve_executor", "vllm_python", "worker_env"]


class VllmEngine:
    """A vLLM worker process for one actor; `generate` sends one round of prompts and waits for its answers."""

    def __init__(self, config: Any, tokenizer: Any, *, log_dir: str | None = None) -> None:
        from transformers import GenerationConfig

        from beagle.prompts import eos_token_ids

        self.config = config
        try:
            generation = GenerationConfig.from_pretrained(config.model_path, local_files_only=True)
        except OSError:  # no generation_config.json: transformers builds it from config.json, as here
            from transformers import AutoConfig

            generation = GenerationConfig.from_model_config(
                AutoConfig.from_pretrained(config.model_path, trust_remote_code=config.trust_remote_code,
                                           local_files_only=True))
        self.eos_ids = eos_token_ids(tokenizer, generation)  # the set the transformers engine stops at
        arguments = ["--dtype", config.dtype, "--max-model-len", str(config.max_prompt_length + config.max_new_tokens),
                     "--max-num-seqs", str(config.batch_size), "--seed", str(config.seed)]
        self.worker = VllmWorkerProcess(config.vllm, config.model_path, arguments,
                                        trust_remote_code=config.trust_remote_code, log_dir=log_dir)
        self.version = self.worker.version
        self.log_path = self.worker.log_path

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[tuple[list[int], bool]]:
        """All of `prompts` at once: vLLM keeps up to --batch-size of them in flight (max_num_seqs)."""
        from pipeline.regenerate.generation import cut_at_eos

        sampling = self.config.temperature > 0
        request = {"prompts": prompts, "seeds": seeds if sampling else [None] * len(prompts),
                   "max_tokens": self.config.max_new_tokens, "temperature": self.config.temperature if sampling else 0.0,
                   "top_p": self.config.top_p if sampling else 1.0, "stop_token_ids": sorted(self.eos_ids)}
        outputs = self.worker.ask(request, "outputs", "generating")
        return [cut_at_eos(row, self.eos_ids) for row in outputs]

    def close(self) -> None:
        self.worker.close()
