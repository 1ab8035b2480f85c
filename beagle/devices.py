"""Where and in what precision a model runs: one device rule and one dtype table for every job.

Extraction, regeneration, training and evaluation all take `--device` and `--dtype` strings; reading
them in one place means a missing GPU or a misspelt dtype is refused with the same message everywhere,
instead of surfacing later as a CUDA error or a `KeyError` inside a Ray worker.
"""
from __future__ import annotations

import torch

# The precisions a target or drafter may be loaded in (`--dtype`); keys are what users type.
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                  "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (a key of DTYPES); a one-line ValueError for any other name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype {name}: unknown dtype; use one of {sorted(DTYPES)}") from None


def pick_device(name: str | None) -> torch.device:
    """The device `name` asks for; None or "auto" picks CUDA when it is available, else the CPU.

    A CUDA device on a machine without CUDA is refused here, with the flag that fixes it, rather than
    failing later when the first tensor moves.
    """
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device name; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available; use --device cpu")
    return device
