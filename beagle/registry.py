"""Every drafter form and every export format, each said once: what `train`, `extract`, `export`, `eval` and
bench ask of a form is a field of its row here (docs/architecture.md, "Adding a drafter form").

A row names its code as "module:attribute" references (or the objects themselves), resolved on first use, so
this module imports no torch: `train --help`, option checks and `extract` read the table without loading a
model. A form's class implements the `Drafter` protocol below. Outside this module and the forms' own
modules nothing asks which form a drafter is (no isinstance, hasattr or kind comparison): callers ask the row.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from beagle.errors import SettingsError

if TYPE_CHECKING:
    from torch import Tensor, nn

RESIDUALS = ("embedding", "state")  # DrafterConfig.residual: what a Beagle block's residual stream starts from


class Drafter(Protocol):
    """What train, export, decode and bench call on a drafter (the frozen `embed_tokens` and `lm_head`
    are buffers; `state_dict()` holds the trained weights only)."""

    config: Any                # beagle.model.DrafterConfig
    drafter_type: str          # the form's name, written to config.json
    carries_state: bool        # whether a query's residual or input takes a state (the parent's, when drafting)
    layer_fusion: "nn.Module | None"  # [.., n_layers * d] -> [.., d] over the key layers; None: keys read one layer
    draft_columns: "Tensor | None"    # [N] token id of each scored logit column; None: all V (column = token id)
    embed_tokens: "Tensor"     # [V, d]
    lm_head: "Tensor"          # [V, d]

    def head_input(self, hidden: "Tensor") -> "Tensor": ...        # draft state -> what the LM head reads
    def logits(self, hidden: "Tensor") -> "Tensor": ...            # [B, L, d] -> [B, L, V]


def resolve(reference: Any) -> Any:
    """The object a row names: "module:attribute" is imported on first use; anything else is itself."""
    if not isinstance(reference, str):
        return reference
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


# --------------------------------------------------------------------------------------------- export formats

@dataclass(frozen=True)
class ExportFormat:
    """One `export --format`: what it writes, how it is served, and the function that writes it. The writer
    takes (drafter folder or module, EngineTarget, out_dir, replace=..., **options), options being the
    `takes` subset of the command's (`embed_tokens`, `dtype`, `speculative_tokens`) plus `fixed`."""

    name: str
    summary: str                              # the `export --help` line
    serve_hint: str                           # printed after writing: "{out}" the folder, "{k}" the draft length
    writer: Any                               # Reference
    needs_target: bool = True                 # the writer reads the target's facts and head (EngineTarget)
    takes: tuple[str, ...] = ("embed_tokens", "dtype")
    fixed: dict[str, Any] = field(default_factory=dict)


EXPORT_FORMATS: dict[str, ExportFormat] = {fmt.name: fmt for fmt in (
    ExportFormat("eagle3", "speculators layout (vLLM, speculators): one EAGLE-3 layer",
                 'vLLM: speculative_config={{"method": "eagle3", "model": "{out}", "num_speculative_tokens": {k}}}',
                 "beagle.engine_export:export_eagle3", takes=("embed_tokens", "dtype", "speculative_tokens"),
                 fixed={"layout": "speculators"}),
    ExportFormat("eagle3-sglang", "SGLang/SpecForge layout: the same layer as midlayer.* (three aux layers)",
                 "SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path {out}",
                 "beagle.engine_export:export_eagle3", takes=("embed_tokens", "dtype", "speculative_tokens"),
                 fixed={"layout": "sglang"}),
    ExportFormat("eagle", "vLLM's EAGLE layout (method \"eagle\")",
                 'vLLM: speculative_config={{"method": "eagle", "model": "{out}", "num_speculative_tokens": {k}}}',
                 "beagle.engine_export:export_eagle"),
    ExportFormat("native", "this project's own drafter folder, for `beagle-pipeline eval`",
                 "beagle-pipeline eval --drafter {out}", "beagle.engine_export:export_native",
                 needs_target=False, takes=()),
)}


# --------------------------------------------------------------------------------------------- drafter forms

@dataclass(frozen=True)
class DrafterForm:
    name: str                          # drafter_type in config.json and run_config.json
    summary: str
    model: Any                         # Reference to the class, built as cls(DrafterConfig, embed_tokens, lm_head)
    residual: str                      # the DrafterConfig.residual the class takes
    train_as: tuple[str, str]          # the (`train --drafter`, `--residual`) that select it
    carries_state: bool                # a query reads a state (its parent's when drafting): stage 2 feeds one back
    losses: tuple[Any, Any]            # References: the loss of training stage 1 and of stage 2
    weights: tuple[Any, Any]           # References: their denominators from the batch alone (gradient accumulation)
    backend: Any                       # Reference: (drafter, concatenate) -> decoding backend (beagle/decoding/drafters.py)
    keys: str = "last"                 # its default key layers: "last" (-1; every captured one with --fuse-layers)
                                       # or "aux" (the residual-stream layers a store captured: EAGLE-3's)
    exports: tuple[str, ...] = ("native",)   # the EXPORT_FORMATS it can express (each writer checks the rest)
    export_hint: str = ""              # said when a format it cannot express is asked for
    train_options: frozenset[str] = frozenset()  # form-specific TrainConfig fields it honours (FORM_OPTIONS)
    optional_concatenation: bool = False   # `eval --no-concat` (drafted states not fed back as keys) applies
    offline_chain: Any = "beagle.offline_acceptance:beagle_chain_tokens"  # Reference: held-out τ's draft chains

    @property
    def simulates(self) -> bool:
        """Whether stage 2 differs from stage 1 (training-time simulation); a teacher-forced form has one loss."""
        return self.losses[0] != self.losses[1]

    def stage_loss(self, stage: int) -> Callable[..., Any]:
        return resolve(self.losses[stage - 1])

    def stage_weights(self, stage: int) -> Callable[..., Any]:
        return resolve(self.weights[stage - 1])

    def chain_tokens(self) -> Callable[..., Any]:
        return resolve(self.offline_chain)

    def build(self, config: Any, embed_tokens: "Tensor", lm_head: "Tensor") -> "nn.Module":
        if config.residual != self.residual:
            raise ValueError(f"drafter form {self.name} has residual {self.residual!r}, the config says "
                             f"{config.residual!r}")
        return resolve(self.model)(config, embed_tokens, lm_head)

    def check_decoding(self, concatenate: bool) -> None:
        """Refuse `eval --no-concat` for a form whose drafting always feeds drafted states back as keys."""
        if not concatenate and not self.optional_concatenation:  # a fact of the drafter given: one line
            raise ValueError(f"--no-concat: drafter form {self.name} always feeds drafted states back as keys "
                                f"(forms that can turn it off: {', '.join(names_where('optional_concatenation'))})")

    def decoding_backend(self, drafter: "nn.Module", concatenate: bool = True) -> Any:
        """The tree builder's view of `drafter`; `concatenate=False` only where the form can draft that way."""
        self.check_decoding(concatenate)
        return resolve(self.backend)(drafter, concatenate)

    def export_format(self, name: str) -> ExportFormat:
        """The format `export --format NAME` writes, once it is known this form can be written in it."""
        if name not in EXPORT_FORMATS:
            raise SettingsError(f"--format {name}: not an export format; use one of {list(EXPORT_FORMATS)}")
        if name not in self.exports:  # about the drafter given, not the flag alone: one line, exit status 1
            raise ValueError(f"--format {name}: drafter form {self.name} has no {name} form (it exports to "
                                f"{', '.join(self.exports)}){'; ' + self.export_hint if self.export_hint else ''}")
        return EXPORT_FORMATS[name]


FORMS: dict[str, DrafterForm] = {form.name: form for form in (
    DrafterForm(
        "beagle", "Beagle as in the paper: the residual starts from the query's embedding (docs/method.md §1)",
        "beagle.model:BeagleDrafter", "embedding", ("beagle", "embedding"), carries_state=False,
        losses=("beagle.stages:stage1_loss", "beagle.stages:stage2_loss"),
        weights=("beagle.stages:stage1_weights", "beagle.stages:stage2_weights"),
        backend="beagle.decoding.drafters:BeagleBackend", train_options=frozenset({"fuse_layers"}),
        optional_concatenation=True,
        export_hint="its residual stream starts from the query's embedding, an engine's from the state: train the "
                    "engine form with `beagle-pipeline train --residual state` for EAGLE-3"),
    DrafterForm(
        "beagle-state", "Beagle in engine form: the residual carries the previous state; exports to EAGLE-3 (§9)",
        "beagle.state_beagle:StateBeagleDrafter", "state", ("beagle", "state"), carries_state=True,
        losses=("beagle.stages:stage1_loss", "beagle.stages:stage2_loss"),
        weights=("beagle.stages:stage1_weights", "beagle.stages:stage2_weights"),
        backend="beagle.decoding.drafters:StateBeagleBackend", keys="aux",
        exports=("eagle3", "eagle3-sglang", "native"), export_hint="use --format eagle3",
        train_options=frozenset({"key_layers", "query_state"})),
    DrafterForm(
        "eagle2", "the EAGLE-2 baseline, teacher-forced in every stage (docs/method.md §7)",
        "beagle.eagle2:Eagle2Drafter", "embedding", ("eagle2", "embedding"), carries_state=True,
        losses=("beagle.eagle2:eagle2_loss", "beagle.eagle2:eagle2_loss"),
        weights=("beagle.eagle2:eagle2_weights", "beagle.eagle2:eagle2_weights"),
        backend="beagle.decoding.drafters:Eagle2Backend", exports=("eagle", "native"),
        export_hint="an EAGLE-2 drafter is not an EAGLE-3 layer: use --format eagle",
        train_options=frozenset({"fuse_layers"}),
        offline_chain="beagle.offline_acceptance:eagle2_chain_tokens"),
)}

# TrainConfig fields that only some forms take (with the value meaning "not asked for"): a form refuses the
# ones outside its `train_options` in one line.
FORM_OPTIONS: dict[str, tuple[str, Any]] = {
    "fuse_layers": ("--fuse-layers", False),
    "key_layers": ("--key-layers", None),
    "query_state": ("--query-state", False),
}


def names_where(attribute: str) -> list[str]:
    """The forms whose row has `attribute` true (for messages naming the forms that do take an option)."""
    return [form.name for form in FORMS.values() if getattr(form, attribute)]


def train_drafters() -> list[str]:
    """`train --drafter`'s choices: every form's first train flag, in table order."""
    return list(dict.fromkeys(form.train_as[0] for form in FORMS.values()))


def form_named(name: str | None, *, where: str = "drafter_type") -> DrafterForm:
    """The form a config.json's drafter_type names ("beagle" when absent: drafters exported before forms)."""
    form = FORMS.get(name or "beagle")
    if form is None:
        raise ValueError(f"{where}={name!r} is not a drafter form; expected one of {sorted(FORMS)}")
    return form


def form_for(drafter: str, residual: str) -> DrafterForm:
    """The form `train --drafter D --residual R` trains (a SettingsError naming the pairs that exist)."""
    for form in FORMS.values():
        if form.train_as == (drafter, residual):
            return form
    if drafter not in train_drafters():
        raise SettingsError(f"drafter={drafter!r} must be one of {train_drafters()}")
    if residual not in RESIDUALS:
        raise SettingsError(f"residual={residual!r} must be one of {list(RESIDUALS)}")
    takes = [f.train_as[1] for f in FORMS.values() if f.train_as[0] == drafter]
    raise SettingsError(f"residual={residual!r}: --drafter {drafter} takes --residual {' or '.join(takes)}")


def refuse_unhonoured_options(form: DrafterForm, values: dict[str, Any]) -> None:
    """One line for a form-specific training option (FORM_OPTIONS) that `form` does not take."""
    for name, (flag, unset) in FORM_OPTIONS.items():
        if name in values and values[name] != unset and name not in form.train_options:
            takes = [f"`--drafter {f.train_as[0]} --residual {f.train_as[1]}`" for f in FORMS.values()
                     if name in f.train_options]
            raise SettingsError(f"{flag} ({name}) does not apply to drafter form {form.name}; it is for "
                                f"{' or '.join(takes) or 'no form'}")


def form_of(model: Any) -> DrafterForm:
    """The form of a built drafter (or of a decoding wrapper around one)."""
    return form_named(getattr(model, "drafter_type", None))


def bare_drafter(model: Any) -> tuple[Any, "Tensor | None"]:
    """(the drafter itself, its draft vocabulary [N] or None) of a drafter or a reduced-vocabulary view of one
    (beagle/decoding/draft_vocab.py), whose `draft_columns` are the vocabulary and `drafter` the drafter."""
    columns = model.draft_columns
    return (model if columns is None else model.drafter), columns




def capture_layers(forms: Iterable[str] | None, num_layers: int) -> list[int]:
    """The store layers `extract` captures so that one store trains each of `forms` (None: every form) on an
    `num_layers`-layer target: -1 (the state the LM head reads, every form's loss target) plus, for a form
    keyed on "aux" layers, EAGLE-3's three (beagle/layer_capture.py)."""
    from beagle.layer_capture import eagle3_aux_layers

    chosen = [form_named(name, where="--layers-for") for name in forms] if forms is not None else FORMS.values()
    aux = any(form.keys == "aux" for form in chosen)
    return [*(eagle3_aux_layers(num_layers) if aux else []), -1]
