"""Which dtype a training step computes in.

Master weights and optimizer state always stay in fp32; bf16 autocast only changes the dtype of the
matmuls (and the frozen loss head, kept once in bf16). On a GPU bf16 is the norm. On a CPU it pays only
where the cores multiply bf16 natively (AMX tiles or AVX512-BF16): there a drafter-sized matmul runs
3-4x faster than in fp32, while a CPU without them emulates bf16 and is slower than fp32. So the default
is decided by the hardware, and `--bf16/--no-bf16` overrides it.
"""
from __future__ import annotations

import logging

import torch

from beagle.model import loss_head

log = logging.getLogger(__name__)


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 in hardware (AMX or AVX512-BF16)."""
    checks = (getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    return any(check is not None and bool(check()) for check in checks)


AUTO_DTYPE = "auto"   # a target's --dtype decided by the hardware that runs it


def resolve_target_dtype(requested: str, *, on_gpu: bool) -> str:
    """The target's dtype name for `--dtype requested`: itself, or for "auto" bfloat16 where it multiplies
    natively (`on_gpu`, or a CPU with AMX/AVX512-BF16) and float32 elsewhere. On an AVX2-only CPU torch
    emulates bf16: there generation ran 3x and extraction's forward 5.5x slower than in fp32 (docs/regenerate.md,
    docs/extract.md; a 2-core AMD EPYC, 2026-12-07)."""
    if requested != AUTO_DTYPE:
        return requested
    return "float32" if bf16_is_emulated(on_gpu=on_gpu) else "bfloat16"


def bf16_is_emulated(*, on_gpu: bool) -> bool:
    """True when bf16 work would run on this CPU without native bf16 (AVX2 only): slower than fp32 there."""
    return not on_gpu and not cpu_has_native_bf16()


def training_dtype(device: torch.device, bf16: bool | None) -> torch.dtype:
    """The autocast dtype of training on `device`: bf16 when asked, fp32 when refused, and with
    `bf16=None` bf16 wherever the hardware runs it fast (any CUDA GPU with bf16, a CPU with AMX/AVX512-BF16)."""
    if bf16 is None:
        if device.type == "cuda":
            bf16 = torch.cuda.is_bf16_supported()
        else:
            bf16 = device.type == "cpu" and cpu_has_native_bf16()
        log.info("training precision on %s: %s (auto)", device, "bf16 autocast" if bf16 else "fp32")
    return torch.bfloat16 if bf16 else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """The autocast context of a training step: enabled for bf16, a no-op for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def keep_frozen_head_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen embedding, LM head and loss head (the draft vocabulary's rows, or the LM head
    itself) once each, in `dtype`: bf16 steps then never recast [V, d] rows chunk by chunk, and no fp32
    copy sits next to the bf16 one (at a 262k vocabulary and d = 4096, 8.6 GB of fp32 per rank saved).
    Exact for heads read from a bf16 store; the trainable weights stay fp32 (autocast's master weights)."""
    if dtype == torch.float32:
        return
    restricted = getattr(model, "loss_head", None)
    model.embed_tokens = model.embed_tokens.to(dtype)     # registered buffers: stay non-persistent
    model.lm_head = model.lm_head.to(dtype)
    if restricted is not None:
        model.loss_head = restricted.to(dtype)
    log.info("frozen head kept in %s: %.1f MiB", dtype, sum(
        t.numel() * t.element_size() for t in {id(t): t for t in (model.embed_tokens, model.lm_head,
                                                                    loss_head(model))}.values()) / 2**20)
