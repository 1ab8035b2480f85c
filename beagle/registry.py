"""Every drafter form in one table: what `train`, `export`, `eval` and bench look up by name (docs/architecture.md §3).

A form names its model class, the loss of each training stage and its decoding backend. The class
implements the `Drafter` protocol below. Adding a form touches this table and the form's own module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from torch import Tensor, nn

from beagle.eagle2 import Eagle2Drafter, eagle2_loss, eagle2_weights
from beagle.model import BeagleDrafter, DrafterConfig
from beagle.stages import stage1_loss, stage1_weights, stage2_loss, stage2_weights
from beagle.state_beagle import StateBeagleDrafter


class Drafter(Protocol):
    """What train, export, decode and bench call on a drafter (the frozen `embed_tokens` and `lm_head`
    are buffers; `state_dict()` holds the trained weights only)."""

    config: DrafterConfig
    drafter_type: str          # the form's name, written to config.json
    carries_state: bool        # whether a query's residual or input takes a state (the parent's, when drafting)
    embed_tokens: Tensor       # [V, d]
    lm_head: Tensor            # [V, d]

    def head_input(self, hidden: Tensor) -> Tensor: ...          # draft state -> what the LM head reads
    def logits(self, hidden: Tensor) -> Tensor: ...              # [B, L, d] -> [B, L, V]


StageLoss = Callable[..., object]   # (model, batch, offset, settings, generator) -> LossSums
StageWeights = Callable[..., Tensor]  # (batch, offset, settings) -> [k] the loss's per-depth row-weight sums


@dataclass(frozen=True)
class DrafterForm:
    name: str                                    # drafter_type in config.json and run_config.json
    model_class: type[nn.Module]
    residual: str                                # DrafterConfig.residual the class takes
    losses: tuple[StageLoss, StageLoss]          # the loss of training stage 1 and of stage 2
    weights: tuple[StageWeights, StageWeights]   # their denominators from the batch alone (gradient accumulation)
    backend: Callable[[nn.Module, bool], object]  # (drafter, concatenate) -> decoding backend (drafters.py)
    summary: str

    def stage_loss(self, stage: int) -> StageLoss:
        return self.losses[stage - 1]

    def stage_weights(self, stage: int) -> StageWeights:
        return self.weights[stage - 1]

    def build(self, config: DrafterConfig, embed_tokens: Tensor, lm_head: Tensor) -> nn.Module:
        return self.model_class(config, embed_tokens, lm_head)


def _backend(name: str) -> Callable[[nn.Module, bool], object]:
    def make(drafter: nn.Module, concatenate: bool) -> object:
        from beagle.decoding import drafters  # decoding imports torch-heavy tree code; only when decoding

        return getattr(drafters, name)(drafter, concatenate)
    return make


FORMS: dict[str, DrafterForm] = {form.name: form for form in (
    DrafterForm("beagle", BeagleDrafter, "embedding", (stage1_loss, stage2_loss), (stage1_weights, stage2_weights),
                _backend("BeagleBackend"),
                "Beagle as in the paper: the residual starts from the query's embedding (docs/method.md §1)"),
    DrafterForm("beagle-state", StateBeagleDrafter, "state", (stage1_loss, stage2_loss),
                (stage1_weights, stage2_weights), _backend("StateBeagleBackend"),
                "Beagle in engine form: the residual carries the previous state; exports to EAGLE-3 (§9)"),
    DrafterForm("eagle2", Eagle2Drafter, "embedding", (eagle2_loss, eagle2_loss), (eagle2_weights, eagle2_weights),
                _backend("Eagle2Backend"),
                "the EAGLE-2 baseline, teacher-forced in every stage (docs/method.md §7)"),
)}


def form_named(name: str | None, *, where: str = "drafter_type") -> DrafterForm:
    """The form a config.json's drafter_type names ("beagle" when absent: drafters exported before forms)."""
    form = FORMS.get(name or "beagle")
    if form is None:
        raise ValueError(f"{where}={name!r} is not a drafter form; expected one of {sorted(FORMS)}")
    return form


def form_for(drafter: str, residual: str) -> DrafterForm:
    """The form `train --drafter D --residual R` trains."""
    if drafter == "beagle":
        return FORMS["beagle-state" if residual == "state" else "beagle"]
    if residual != "embedding":
        raise ValueError(f"--residual {residual} is a Beagle form; --drafter {drafter} has its own input")
    return form_named(drafter, where="--drafter")


def form_of(model: nn.Module) -> DrafterForm:
    """The form of a built drafter (or of a decoding wrapper around one)."""
    return form_named(getattr(model, "drafter_type", None))


def build_drafter(form: DrafterForm, config: DrafterConfig, embed_tokens: Tensor, lm_head: Tensor) -> nn.Module:
    if config.residual != form.residual:
        raise ValueError(f"drafter form {form.name} has residual {form.residual!r}, the config says "
                         f"{config.residual!r}")
    return form.build(config, embed_tokens, lm_head)
