"""Trainer configuration: one frozen dataclass, laptop-CPU defaults, loadable from TOML or JSON.

Method defaults follow the paper (window 5, 4 simulation steps, lr 3e-5 after 2000 warm-up steps,
noise 0.2, clip 0.5). Sizes default to what a laptop CPU finishes: 2 + 2 epochs of 4096-token
batches. For tiny test models use a larger lr (1e-3) and a short warm-up (see docs/training.md).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from beagle.errors import SettingsError, refuse_non_finite
from beagle.registry import FORM_OPTIONS, form_for, refuse_unhonoured_options


LR_SCHEDULES = ("constant", "cosine", "linear")  # `train --lr-schedule`: what follows the linear warm-up


@dataclass(frozen=True)
class TrainConfig:
    # schedule
    stage1_epochs: int = 2
    stage2_epochs: int = 2
    max_steps: int | None = None          # stop after this many optimizer steps in total
    # method
    drafter: str = "beagle"               # beagle | eagle2 (the baseline, docs/method.md §7: teacher-forced)
    window_size: int = 5                  # k: stage-1 block size and the drafting depth trained
    simulation_steps: int = 4             # s <= k: stage-2 depths simulated with fed-back states
    noise_std: float = 0.2                # Gaussian key noise, as a fraction of the states' RMS
    regression_weight: float = 10.0       # SmoothL1 weight relative to the soft cross-entropy
    detach_feedback: bool = False         # cut gradients through fed-back predicted states
    stage2_recompute: bool = True         # recompute each stage-2 step in backward: memory flat in s
    fuse_layers: bool = False             # keys from a fusion of every layer the stores captured (EAGLE-3 style)
    residual: str = "embedding"           # embedding | state: the Beagle residual stream (docs/method.md §9)
    key_layers: tuple[int, ...] | None = None  # residual state: which captured layers (0..n-1) make keys; None: all
    query_state: bool = False             # residual state: queries also read the previous state (EAGLE-3's full q)
    init_from_target: str | None = None   # local HF model folder: start the block from its decoder layer init_layer
    init_layer: int = -1                  # which decoder layer (negative: from the end)
    # optimisation
    batch_tokens: int = 4096              # padded tokens per batch (B * max length), the global batch under DDP
    rank_batch_tokens: int | None = None  # instead: tokens per data-parallel rank; global = this x world size
    min_batch_rows: int = 1               # samples per batch at least; raised to world size x grad_accum
    grad_accum: int = 1                   # micro-batches per optimizer step: each batch's rows split G ways
    max_length: int | None = None         # truncate samples; default batch_tokens
    lr: float = 3e-5
    warmup_steps: int = 2000
    lr_schedule: str = "constant"         # after warm-up: constant, or cosine / linear decay to 0 at the last step
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    vocab_chunk: int | None = None        # soft cross-entropy over this many vocab rows at once; None: by device
    draft_vocab: int = 0                  # N > 0: token loss over the N most frequent predicted tokens only
    # runtime
    seed: int = 0
    device: str = "auto"                  # auto | cpu | cuda | cuda:N
    bf16: bool | None = None              # bf16 autocast; None: where the hardware runs it fast (beagle/precision.py)
    checkpoint_every: int = 500
    rms_samples: int = 64                 # samples read to measure the states' RMS for the noise
    # held-out validation (beagle/validation.py)
    val_samples: int = 0                  # N > 0: hold N samples out of training (by seed); with val_store: N of it
    val_store: str | None = None          # a store of the same target to validate on instead (all of it when N = 0)
    eval_every: int = 500                 # steps between validations (and one at the end)

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        try:  # the drafter form, and the form-specific options it takes: its row of beagle/registry.py
            refuse_unhonoured_options(form_for(self.drafter, self.residual),
                                      {name: getattr(self, name) for name in FORM_OPTIONS})
        except SettingsError as error:
            raise SettingsError(f"invalid training config: {error}") from None
        checks = [
            (self.window_size >= 1, "window_size must be >= 1"),
            (1 <= self.simulation_steps <= self.window_size,
             f"simulation_steps={self.simulation_steps} must lie in 1..window_size ({self.window_size})"),
            (self.stage1_epochs >= 0 and self.stage2_epochs >= 0, "epochs must be >= 0"),
            (self.stage1_epochs + self.stage2_epochs > 0, "stage1_epochs + stage2_epochs must be > 0"),
            (self.max_steps is None or self.max_steps > 0, "max_steps must be > 0"),
            (self.batch_tokens >= 2, "batch_tokens must be >= 2"),
            (self.rank_batch_tokens is None or self.rank_batch_tokens >= 2, "rank_batch_tokens must be >= 2"),
            (self.min_batch_rows >= 1, "min_batch_rows must be >= 1"),
            (self.max_length is None or self.max_length >= 2, "max_length must be >= 2"),
            (self.lr > 0, "lr must be > 0"),
            (self.warmup_steps >= 0, "warmup_steps must be >= 0"),
            (self.lr_schedule in LR_SCHEDULES, f"lr_schedule={self.lr_schedule!r} must be one of {list(LR_SCHEDULES)}"),
            (self.noise_std >= 0, "noise_std must be >= 0"),
            (self.regression_weight >= 0, "regression_weight must be >= 0"),
            (self.grad_clip > 0, "grad_clip must be > 0"),
            (self.vocab_chunk is None or self.vocab_chunk >= 1, "vocab_chunk must be >= 1"),
            (self.draft_vocab >= 0, "draft_vocab must be >= 0 (0 = the full vocabulary)"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (self.grad_accum >= 1, f"grad_accum={self.grad_accum} must be >= 1 (--grad-accum: micro-batches per "
                                   "optimizer step; 1 = no accumulation)"),
            (self.val_samples >= 0, f"val_samples={self.val_samples} must be >= 0 (--val-samples: samples held out "
                                    "for validation; 0 = none)"),
            (self.eval_every >= 1, f"eval_every={self.eval_every} must be >= 1 (--eval-every: optimizer steps "
                                   "between validations)"),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(f"invalid training config: {message}")

    def for_world_size(self, world_size: int) -> "TrainConfig":
        """The settings a run of `world_size` data-parallel ranks trains with. With `rank_batch_tokens` the
        global batch grows with the ranks (rank_batch_tokens x world_size), so each GPU gets the same budget
        whatever their number, and samples default to one rank's budget (a longer one would overfill its
        rank). The run config records the result; a resume with another world size is then refused."""
        if self.rank_batch_tokens is None:
            return self
        return replace(self, batch_tokens=self.rank_batch_tokens * world_size,
                       max_length=self.max_length or self.rank_batch_tokens)

    @property
    def validates(self) -> bool:
        """Whether the run holds samples out (or reads a validation store) and evaluates them."""
        return self.val_samples > 0 or self.val_store is not None

    @property
    def sequence_limit(self) -> int:
        return min(self.max_length or self.batch_tokens, self.batch_tokens)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        if self.key_layers is not None:
            d["key_layers"] = list(self.key_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise SettingsError(f"{source}: unknown training option(s) {unknown}; valid keys: {sorted(names)}")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(float(b) for b in d["betas"])
        if d.get("key_layers") is not None:
            d["key_layers"] = tuple(int(layer) for layer in d["key_layers"])
        return cls(**d)

    def override(self, **changes: Any) -> "TrainConfig":
        """Apply CLI flags that were given (None means not given)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def load_config_file(path: str | Path) -> TrainConfig:
    """Read a TOML (.toml) or JSON file into TrainConfig; unknown keys are an error."""
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"--config {path}: file not found")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import tomllib  # Python >= 3.11; use a .json config on 3.10

            data = tomllib.loads(text)
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are both ValueErrors
        raise SettingsError(f"{path}: cannot parse ({exc}); use TOML (.toml) or JSON (.json)") from exc
    if isinstance(data.get("train"), dict) and len(data) == 1:  # allow a [train] table
        data = data["train"]
    return TrainConfig.from_dict(data, source=str(path))
