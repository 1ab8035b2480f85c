"""speculators' own trainer (`python -m speculators.train`, 0.9.0) on a machine without an accelerator.

    .venv-speculators/bin/python bench/speculators_cpu.py ARGS...   # exactly `python -m speculators.train ARGS`

Its Trainer moves the model and every batch to `get_local_rank()` (an int, which torch reads as CUDA device
0) and runs autocast for `torch.accelerator.current_accelerator()` or else "cuda"; its step timer calls
`torch.accelerator.synchronize()`. On a CPU-only machine each of those fails, so this wrapper changes them
and nothing else: the device is "cpu", autocast is the CPU's (bf16, as on a GPU), the timer's synchronize
is a no-op when there is no accelerator. Every other line, default and flag is speculators' own; bench/peer.py
says so in its results. Read, not copied: speculators/train/trainer.py and distributed.py.
"""
from __future__ import annotations

import runpy

import torch

import speculators.train.trainer as trainer_module

if torch.accelerator.current_accelerator() is None:
    original_init = trainer_module.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.local_rank = "cpu"      # `.to(self.local_rank)` for the model and every batch
        self.device_type = "cpu"     # `torch.autocast(self.device_type, dtype=hidden_states_dtype)`

    trainer_module.Trainer.__init__ = cpu_init
    trainer_module.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None

runpy.run_module("speculators.train", run_name="__main__", alter_sys=True)
