"""Checkpoints without pickle: weights and optimizer tensors in safetensors, everything else in JSON.

RUN/checkpoints/step-00000042/ holds model.safetensors, optimizer.safetensors (AdamW moments, step
counters and the RNG state) and state.json (data position, optimizer param groups). state.json is
written last, so a directory without it is an interrupted write and is ignored.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.store.atomic import commit_directory

log = logging.getLogger(__name__)

STATE_NAME = "state.json"


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    sd = optimizer.state_dict()
    tensors = {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{index}.{name}"] = tensor.detach().to("cpu").contiguous()
    return tensors, sd["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], param_groups: list[dict]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if not key.startswith("state."):
            continue
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in param_groups]
    return {"state": state, "param_groups": groups}


def save_checkpoint(run_dir: Path, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, position: dict[str, int], keep: int = 2) -> Path:
    """Write a checkpoint for `step` and drop all but the newest `keep`."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    for stale in root.glob(".step-*.tmp"):  # this one's earlier attempt, or one a killed process left
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()},
              str(tmp / "model.safetensors"))
    tensors, groups = _flatten_optimizer(optimizer)
    tensors["rng.generator"] = generator.get_state().to("cpu")
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    state = {"step": step, "position": position, "param_groups": groups,
             "generator_device": str(generator.device)}
    (tmp / STATE_NAME).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    commit_directory(tmp, final, replace=True)  # fsynced, then renamed: a crash leaves old or new, whole
    for old in sorted(p for p in root.glob("step-*") if (p / STATE_NAME).is_file())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s", final)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / STATE_NAME).is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator) -> dict[str, Any]:
    """Restore model, optimizer and RNG in place; returns state.json (step, data position)."""
    state = json.loads((path / STATE_NAME).read_text(encoding="utf-8"))
    device = next(model.parameters()).device
    weights = load_file(str(path / "model.safetensors"), device=str(device))
    model.load_state_dict(weights, strict=True)
    tensors = load_file(str(path / "optimizer.safetensors"))
    generator.set_state(tensors.pop("rng.generator"))
    optimizer.load_state_dict(_unflatten_optimizer(tensors, state["param_groups"]))
    return state
