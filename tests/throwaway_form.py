"""A throwaway drafter form, for tests/test_adding_a_form.py: the one module a new form brings.

Its class is the paper's Beagle under another name whose LM head reads the draft state through a learned
per-channel gain: one more trained tensor, so training, saving, loading, decoding and exporting all carry
something Beagle does not have (and no engine layout has a place for it). Its row below is the one line of beagle/registry.py's FORMS a new form adds (the test adds it for its duration);
nothing else in the project names it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from beagle.model import BeagleDrafter
from beagle.registry import DrafterForm


class ThrowawayDrafter(BeagleDrafter):
    """Beagle whose LM head reads gain * ĥ (gain [d], trained, starting at 1)."""

    drafter_type = "throwaway"

    def __init__(self, config, embed_tokens: Tensor, lm_head: Tensor) -> None:
        super().__init__(config, embed_tokens, lm_head)
        self.head_gain = nn.Parameter(torch.ones(config.hidden_size))

    def head_input(self, hidden: Tensor) -> Tensor:  # [B, L, d] -> [B, L, d]
        return hidden * self.head_gain.to(hidden.dtype)


ROW = DrafterForm(
    "throwaway", "a test's form: Beagle with a learned gain before the LM head", ThrowawayDrafter, "embedding",
    ("throwaway", "embedding"), carries_state=False,
    losses=("beagle.stages:stage1_loss", "beagle.stages:stage2_loss"),
    weights=("beagle.stages:stage1_weights", "beagle.stages:stage2_weights"),
    backend="beagle.decoding.drafters:BeagleBackend")
