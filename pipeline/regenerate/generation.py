"""The target answers conversations turn by turn, through one of two engines.

Every conversation of a chunk asks its first turn in one round, then its second turn (with its own first
answer in the context), and so on: MT-Bench-style follow-ups refer to the earlier answer. What is asked
(the chat template, the prompt-length rule, the rejects) and how answers are cut and decoded is decided
here, once, whatever runs the model: `TransformersEngine` (left-padded batches of `--batch-size` through
transformers `generate`, rows sorted by prompt length so that padding stays small) or, with `--engine vllm`,
`pipeline.regenerate.vllm_engine.VllmEngine` (the whole round to vLLM at once: continuous batching, paged
attention). Both take token ids and give back token ids.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from beagle.devices import pick_device
from beagle.errors import BeagleError
from beagle.prompts import eos_token_ids, render
from beagle.records import TEXT_ROLE, RejectReason
from beagle.precision import AUTO_DTYPE, resolve_target_dtype
from beagle.target_model import TargetSpec
from pipeline.jobkit.target import load_tokenizer
from pipeline.regenerate.prompts import PromptRecord
from pipeline.jobkit.vllm_process import ENGINES, VllmConfig  # noqa: F401 - ENGINES: the choices of --engine

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class GenerateConfig:
    model_path: str
    dtype: str = "auto"           # auto: bf16 on a GPU or a CPU that multiplies it natively, else fp32
    max_new_tokens: int = 512     # per answer; a longer answer is cut there (counted as unfinished)
    max_prompt_length: int = 2048  # prompt tokens, history included; a turn beyond it ends the conversation
    max_turns: int = 0            # user turns answered per conversation; 0 = all
    batch_size: int = 32          # rows per generate call
    temperature: float = 0.0      # 0: greedy, the target's output under `eval --temperature 0`
    top_p: float = 1.0
    seed: int = 0
    device: str | None = None     # None: cuda when available, else cpu
    threads: int | None = None
    trust_remote_code: bool = False
    engine: str = "hf"            # hf: transformers `generate` in the actor; vllm: vllm.LLM in a worker process
    vllm: VllmConfig = field(default_factory=lambda: VllmConfig())

    @property
    def target(self) -> TargetSpec:
        """How the actor opens the target: the one `TargetSpec` every command uses. The job resolves `auto`
        before its identity (pipeline/regenerate/job.py `resolve_dtype`); a generator built directly resolves
        it here, for the device it runs on."""
        dtype = self.dtype
        if dtype == AUTO_DTYPE:
            dtype = resolve_target_dtype(dtype, on_gpu=pick_device(self.device).type == "cuda")
        return TargetSpec(self.model_path, dtype, self.trust_remote_code)


@dataclass
class Answered:
    """One regenerated conversation, or why its first turn could not be asked."""

    record: PromptRecord
    messages: list[dict[str, str]]
    text: str | None = None       # a text record: its text and the target's continuation
    generated_tokens: int = 0
    unfinished_turns: int = 0     # answers cut at max_new_tokens
    dropped_turns: int = 0        # later turns not asked: their prompt grew past max_prompt_length
    reject: str | None = None     # "prompt_too_long" when not even the first turn fits


class Engine(Protocol):
    """What runs the model: prompts as token ids in, (answer tokens without EOS, ended with EOS) out."""

    eos_ids: set[int]

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[tuple[list[int], bool]]: ...


def cut_at_eos(row: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    """An answer's tokens up to its first EOS, and whether it had one (else it stopped at max_new_tokens)."""
    end = next((i for i, token in enumerate(row) if token in eos_ids), None)
    return (row, False) if end is None else (row[:end], True)


class TransformersEngine:
    """The target in this process, left-padded batches of `batch_size` through transformers `generate`."""

    def __init__(self, config: GenerateConfig, tokenizer: Any) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = pick_device(config.device)
        self.model = config.target.load_model(self.device)
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id
        self.eos_ids = eos_token_ids(tokenizer, self.model.generation_config)

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[tuple[list[int], bool]]:
        """Batches of `batch_size` in the given order; sampling follows the chunk's torch seed, not `seeds`."""
        step = self.config.batch_size
        return [answer for start in range(0, len(prompts), step) for answer in self._batch(prompts[start:start + step])]

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, W], left padded
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        sampling = self.config.temperature > 0
        output = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            max_new_tokens=self.config.max_new_tokens, do_sample=sampling,
            temperature=self.config.temperature if sampling else None,
            top_p=self.config.top_p if sampling else None, top_k=None,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))  # [B, W + new]
        return [cut_at_eos(row, self.eos_ids) for row in output[:, width:].tolist()]


def request_seed(chunk_seed: int, row: int, turn: int) -> int:
    """vLLM's per-request sampling seed: fixed by the chunk's seed, the record's place in it and the turn, so
    a chunk's sampled answers do not depend on which actor ran it, nor on what else was in flight."""
    digest = hashlib.blake2b(f"{chunk_seed}/{row}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


class ConversationGenerator:
    """Holds the engine and the target's tokenizer; `answer` regenerates a chunk of conversations."""

    def __init__(self, config: GenerateConfig, *, log_dir: str | None = None) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model_path, trust_remote_code=config.trust_remote_code)
        if config.engine == "vllm":
            from pipeline.regenerate.vllm_engine import VllmEngine

            self.engine: Engine = VllmEngine(config, self.tokenizer, log_dir=log_dir)
        else:
            self.engine = TransformersEngine(config, self.tokenizer)
        self.eos_ids = self.engine.eos_ids
        if not self.eos_ids:
            raise ValueError(f"--model {config.model_path}: no eos_token_id in the tokenizer or generation "
                             "config; answers could never end")

    @property
    def model(self) -> Any:
        """The transformers model (the hf engine only; bench/regenerate.py decodes with it too)."""
        return self.engine.model

    @property
    def pad_id(self) -> int:
        return self.engine.pad_id

    def answer(self, records: list[PromptRecord], *, seed: int) -> list[Answered]:
        """Regenerate every assistant turn of `records`; `seed` fixes sampling for this chunk."""
        torch.manual_seed(seed)
        results = [Answered(r, [{"role": "system", "content": s} for s in r.system]) for r in records]
        turns = max(len(r.turns) for r in records)
        for turn in range(min(turns, self.config.max_turns) if self.config.max_turns else turns):
            asking: list[tuple[Answered, list[int], int]] = []
            for row, result in enumerate(results):
                if turn >= len(result.record.turns) or result.reject or result.dropped_turns:
                    continue
                ids = render(self.tokenizer, self._context(result, turn))
                if len(ids) > self.config.max_prompt_length:
                    if turn == 0:
                        result.reject = RejectReason.PROMPT_TOO_LONG.value
                    else:
                        result.dropped_turns = len(result.record.turns) - turn
                    continue
                asking.append((result, ids, request_seed(seed, row, turn)))
            if not asking:
                continue
            asking.sort(key=lambda item: len(item[1]))
            answers = self.engine.generate([ids for _, ids, _ in asking], [s for _, _, s in asking])
            for (result, ids, _), (tokens, finished) in zip(asking, answers):
                question = result.record.turns[turn]
                if result.record.text:
                    result.text = question + self._continuation(ids, tokens)
                else:
                    result.messages += [{"role": "user", "content": question},
                                        {"role": "assistant",
                                         "content": self.tokenizer.decode(tokens, skip_special_tokens=True)}]
                result.generated_tokens += len(tokens)
                result.unfinished_turns += not finished
        return results

    @staticmethod
    def _context(result: Answered, turn: int) -> list[dict[str, str]]:
        """The messages the next answer is asked with: a text record's text, or the conversation so far."""
        question = result.record.turns[turn]
        if result.record.text:
            return [{"role": TEXT_ROLE, "content": question}]
        return [*result.messages, {"role": "user", "content": question}]

    def _continuation(self, prompt_ids: list[int], tokens: list[int]) -> str:
        """The text `tokens` add after `prompt_ids`: decoded together, so that the join keeps the space or
        merged characters a tokenizer would lose decoding the continuation alone."""
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        return self.tokenizer.decode(prompt_ids + tokens, skip_special_tokens=True)[len(prompt):]


def chunk_lines(answered: list[Answered]) -> str:
    """A finished chunk as the driver commits it: one JSON line per record, its conversation or its reject."""
    lines = []
    for result in answered:
        record = result.record
        where = {"source": record.source, "index": record.index, **({"line": record.line} if record.line else {})}
        if result.reject:
            lines.append({"reject": {**where, "reason": result.reject,
                                     "detail": "the first turn's prompt is longer than --max-prompt-length"}})
        else:
            body = {"text": result.text} if record.text else {"messages": result.messages}
            lines.append({"id": record.sample_id, **body, "source": where,
                          "regenerated": {"tokens": result.generated_tokens, "unfinished_turns": result.unfinished_turns,
                                          "dropped_turns": result.dropped_turns}})
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


class ChunkAnswerer:
    """Generation actor: loads the target once; per call, regenerates one chunk of conversations.

    It returns the chunk's lines as text, and the driver writes them (the driver's disk holds the output,
    which an actor on another node cannot reach), so a chunk is either wholly on disk or redone. Plain
    Python: the job kit's dispatcher makes it a Ray actor; tests call it directly.
    """

    def __init__(self, config: GenerateConfig, log_dir: str | None = None) -> None:
        # An engine that cannot start (vLLM refusing the model) is raised by the first chunk's call: Ray hands
        # a method's exception back as itself, for the one-line report, but a constructor's only as text.
        self.failed: BeagleError | None = None
        try:
            self.generator = ConversationGenerator(config, log_dir=log_dir)
        except BeagleError as error:
            self.failed = error

    def close(self) -> None:
        """End the engine (a vLLM worker process); the dispatcher calls it before it stops the actor."""
        engine = getattr(getattr(self, "generator", None), "engine", None)
        if engine is not None and hasattr(engine, "close"):
            engine.close()

    def answer(self, chunk_index: int, records: list[PromptRecord]) -> dict[str, Any]:
        """{"chunk", "lines", "conversations", "tokens", "seconds", "pid"} of chunk `chunk_index`; sampling
        is seeded with seed + chunk index, so the answers do not depend on which actor ran it."""
        if self.failed is not None:
            raise self.failed
        started = time.perf_counter()
        results = self.generator.answer(records, seed=self.generator.config.seed + int(chunk_index))
        seconds = time.perf_counter() - started
        logger.info("chunk %d: %d conversations in %.1fs (pid %d)", chunk_index, len(results), seconds, os.getpid())
        return {"chunk": int(chunk_index), "lines": chunk_lines(results), "conversations": len(results),
                "tokens": sum(r.generated_tokens for r in results), "seconds": seconds, "pid": os.getpid()}
