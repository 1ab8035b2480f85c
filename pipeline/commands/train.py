"""`beagle-pipeline train`: the one training command. It trains in this process (or in one torchrun rank:
`torchrun --nproc-per-node N -m pipeline.commands.train ...`), or, given --num-workers N, runs the same loop
on N Ray Train workers (`pipeline.train_launch`; Ray is imported only then).

Every TrainConfig setting has one option here, declared with `override_option`: the option is None unless
given (then defaults, then --config FILE, then the flags decide) and its help shows the dataclass's default,
rendered from the field, never retyped (tests/test_settings_once.py). The library draws nothing and knows
no click: the progress bar and the curves are drawn here.
"""
from __future__ import annotations

from typing import Any

import click

from beagle.errors import SettingsError
from beagle.registry import RESIDUALS, train_drafters
from beagle.train_config import LR_SCHEDULES, TrainConfig, load_config_file
from pipeline.commands.errors import reports_errors
from pipeline.commands.options import override_option

# The parameters of `train` that are not TrainConfig keys (the rest of its options override the config).
RUN_OPTIONS = ("stores", "run_dir", "config_file", "resume", "progress", "cache_dir", "verify_store",
               "num_workers", "address")


def build_config(config_file: str | None, flags: dict[str, Any]) -> TrainConfig:
    """Defaults, then --config FILE, then the flags given (None: not given); SettingsError names a bad one."""
    if flags.get("batch_tokens") is not None and flags.get("rank_batch_tokens") is not None:
        raise SettingsError("--batch-tokens and --rank-batch-tokens both given; pass one (the global batch, or "
                            "each rank's)")
    base = load_config_file(config_file) if config_file else TrainConfig()
    return base.override(**{key: value for key, value in flags.items() if value is not None})


def _layer_list(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated layer indices, e.g. 2,15,27") from None


class _DrafterChoice(click.Choice):
    """`--drafter`'s choices, read from beagle/registry.py when asked (a form added to the table is offered)."""

    def __init__(self) -> None:
        super().__init__([])

    @property
    def choices(self) -> list[str]:
        return train_drafters()

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it; the table is the one list
        pass


def _config_option(name: str, *decls: str, help: str, **kwargs: Any):
    return override_option(TrainConfig, name, *decls, help=help, **kwargs)


@click.command("train")
@click.option("--store", "stores", multiple=True, required=True,
              help="Feature store (path or fsspec URL); repeat to train on several stores of one target.")
@click.option("--out", "run_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory: metrics, checkpoints, drafter/ export, curves.png.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="TOML or JSON file with TrainConfig keys; flags given here override it.")
@_config_option("drafter", "--drafter", type=_DrafterChoice(),
                help="Drafter to train, a form of beagle/registry.py with --residual: beagle (the paper's "
                     "Beagle; with --residual state its engine form), or eagle2, the EAGLE-2 baseline (all epochs "
                     "teacher-forced).")
@_config_option("stage1_epochs", "--stage1-epochs", type=int, help="Epochs of stage 1 (block attention).")
@_config_option("stage2_epochs", "--stage2-epochs", type=int, help="Epochs of stage 2 (training-time simulation).")
@_config_option("max_steps", "--max-steps", type=int, help="Stop after this many optimizer steps in total.")
@_config_option("window_size", "--window-size", type=int, help="Window size k.")
@_config_option("simulation_steps", "--simulation-steps", type=int, help="Stage-2 depths s <= k.")
@_config_option("batch_tokens", "--batch-tokens", type=int,
                help="Padded tokens per batch; under data parallelism the global batch, split over the ranks.")
@_config_option("rank_batch_tokens", "--rank-batch-tokens", type=int,
                help="Instead of --batch-tokens: padded tokens per data-parallel rank (the global batch is this "
                     "times the number of ranks; samples default to this length).")
@_config_option("max_length", "--max-length", type=int, help="Truncate samples to this many tokens.",
                default_note="batch-tokens")
@_config_option("grad_accum", "--grad-accum", type=int,
                help="Gradient accumulation: split each batch's samples into G micro-batches, forward and backward "
                     "one at a time, one optimizer step per batch (same update, 1/G of the activation memory; "
                     "the paper's 16 x 2048 on one GPU: --batch-tokens 32768 --max-length 2048 --grad-accum 4).")
@_config_option("lr", "--lr", type=float, help="Peak learning rate.")
@_config_option("warmup_steps", "--warmup-steps", type=int, help="Linear warm-up steps.")
@_config_option("weight_decay", "--weight-decay", type=float, help="AdamW weight decay (decoupled).")
@_config_option("lr_schedule", "--lr-schedule", type=click.Choice(list(LR_SCHEDULES)),
                help="After the warm-up: keep the peak rate, or decay it (cosine, linear) to 0 at the last step.")
@_config_option("noise_std", "--noise-std", type=float, help="Key noise std as a fraction of the states' RMS.")
@_config_option("regression_weight", "--regression-weight", type=float,
                help="Weight of the SmoothL1 regression of the drafted states next to the token loss (the "
                     "method's 10; 0 trains the token loss alone, see docs/training.md).")
@_config_option("fuse_layers", "--fuse-layers/--no-fuse-layers",
                help="Make true keys from a fusion of every layer the stores captured (extract --layers 8,16,-1), "
                     "EAGLE-3 style; the drafter still predicts and is scored on the last layer.")
@_config_option("residual", "--residual", type=click.Choice(list(RESIDUALS)),
                help="Beagle's residual stream: the query's embedding (the paper's form), or the previous "
                     "position's state, the engine form that `export --format eagle3` serves in vLLM/SGLang "
                     "(docs/method.md §9; keys from the layers --key-layers names).")
@_config_option("key_layers", "--key-layers", callback=lambda ctx, param, value: _layer_list(value),
                help="With --residual state: the captured layers (HF hidden_states indices 0..n-1, the residual "
                     "stream entering decoder layer i) whose states make the keys, e.g. 2,15,27.",
                default_note="every captured layer but -1")
@_config_option("query_state", "--query-state/--no-query-state",
                help="With --residual state: the queries also read the previous state (EAGLE-3's q over "
                     "[embedding; state]; still one EAGLE-3 layer), not the embedding alone.")
@_config_option("init_from_target", "--init-from-target", type=click.Path(file_okay=False),
                help="A local Hugging Face folder of the store's target: start the block from its decoder layer "
                     "--init-layer (attention, MLP, norms; the output norm from its final norm) instead of noise. "
                     "Only its safetensors are read; the target never runs (docs/training.md).")
@_config_option("init_layer", "--init-layer", type=int,
                help="With --init-from-target: which decoder layer (negative counts from the end).")
@_config_option("detach_feedback", "--detach-feedback/--no-detach-feedback",
                help="Cut gradients through fed-back predicted states in stage 2.")
@_config_option("vocab_chunk", "--vocab-chunk", type=int,
                help="Vocabulary rows per soft cross-entropy chunk.",
                default_note="1024 on a CPU, where the blocks then stay in cache (training 1.6x faster than at "
                             "8192); 8192 on a GPU")
@_config_option("draft_vocab", "--draft-vocab", type=int,
                help="Train the token loss over the N most frequent predicted tokens only (0: all). Several "
                     "times faster on CPU; the export records them and `eval` drafts over the same.")
@_config_option("checkpoint_every", "--checkpoint-every", type=int, help="Steps between checkpoints.")
@_config_option("val_samples", "--val-samples", type=int,
                help="Hold N samples of the stores out of training (chosen by --seed) and report their loss and "
                     "offline acceptance per depth and tau in metrics.jsonl; with --val-store, N of that store "
                     "(0: all of it). 0 without --val-store: no validation.")
@_config_option("val_store", "--val-store",
                help="Validate on this store (same target, other samples) instead of holding training samples "
                     "out; all of it unless --val-samples N.")
@_config_option("eval_every", "--eval-every", type=int,
                help="Optimizer steps between validations; one also runs at the end.")
@_config_option("device", "--device", help="auto, cpu, cuda or cuda:N.")
@_config_option("bf16", "--bf16/--no-bf16",
                help="bf16 autocast (weights and optimizer state stay fp32).",
                default_note="on where the hardware multiplies bf16 natively: CUDA, or a CPU with AMX/AVX512-BF16")
@_config_option("seed", "--seed", type=int, help="Seed for init, batch order, offsets and noise.")
@click.option("--cache-dir", type=click.Path(file_okay=False),
              help="Local folder caching the files read from remote (fsspec URL) stores.")
@click.option("--num-workers", type=int,
              help="Train on N Ray Train workers (DDP; one GPU each where the cluster has GPUs).")
@click.option("--address", help="Ray cluster to join with --num-workers (default: RAY_ADDRESS or a local Ray).")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--verify-store/--no-verify-store", default=True,
              help="Check each store file's checksum on first read; refuse a damaged store. [on]")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
@reports_errors
def train(stores: tuple[str, ...], run_dir: str, config_file: str | None, resume: bool, progress: bool,
          cache_dir: str | None, verify_store: bool, num_workers: int | None, address: str | None,
          **flags: Any) -> None:
    """Train a Beagle drafter on feature stores (stage 1, then stage 2) and export RUN/drafter/.

    Several processes: `torchrun --nproc-per-node N -m pipeline.commands.train ...`, or --num-workers N
    (Ray Train)."""
    config = build_config(config_file, flags)
    if num_workers is not None or address is not None:
        _train_on_ray(list(stores), run_dir, config, num_workers, address, resume, cache_dir)
    else:
        _train_here(list(stores), run_dir, config, resume, progress, cache_dir, verify_store)


def _train_here(stores: list[str], run_dir: str, config: TrainConfig, resume: bool, progress: bool,
                cache_dir: str | None, verify_store: bool) -> None:
    from tqdm import tqdm

    from beagle.devices import pick_device
    from beagle.trainer import train as run_training
    from pipeline.commands.curves import draw_run_curves
    from pipeline.commands.host_allocator import train_under_jemalloc

    train_under_jemalloc(pick_device(config.device).type)  # on a CPU: may start this command again, under jemalloc
    bar = None

    def on_step(metrics: dict, total: int) -> None:
        nonlocal bar
        if not progress:
            return
        if bar is None:
            bar = tqdm(total=total, initial=metrics["step"] - 1, desc="train", unit="step")
        bar.set_postfix(stage=metrics["stage"], loss=f"{metrics['loss']:.4f}",
                        acc1=f"{metrics['accuracy'][0] or 0:.2f}")
        bar.update(1)

    try:
        result = run_training(stores, run_dir, config, resume=resume, on_step=on_step, on_finish=draw_run_curves,
                              cache_dir=cache_dir, verify_store=verify_store)
    finally:
        if bar is not None:
            bar.close()
    final = result.final_metrics or {}
    held_out = "" if result.validation is None else (
        f"; held-out loss {result.validation['loss']:.4f}, tau {result.validation['tau']:.3f}")
    click.echo(f"trained {result.steps} steps; final loss {final.get('loss', float('nan')):.4f}{held_out}; "
               f"drafter in {result.run_dir / 'drafter'}")


def _train_on_ray(stores: list[str], run_dir: str, config: TrainConfig, num_workers: int | None,
                  address: str | None, resume: bool, cache_dir: str | None) -> None:
    from pathlib import Path

    if num_workers is None:
        raise SettingsError("--address joins a Ray cluster for Ray Train; give --num-workers N with it")
    if num_workers < 1:
        raise SettingsError(f"--num-workers {num_workers} must be >= 1")
    from pipeline.commands.curves import draw_run_curves
    from pipeline.train_launch import launch  # the only path that loads Ray

    try:
        final = launch(stores, run_dir, config, num_workers=num_workers, address=address, resume=resume,
                       cache_dir=cache_dir)
    except Exception as exc:  # Ray wraps worker errors (our ValueErrors among them)
        raise click.ClickException(f"Ray Train run failed: {str(exc).strip().splitlines()[-1]}") from exc
    if (Path(run_dir) / "metrics.jsonl").is_file():  # rank 0's log, where the driver shares its file system
        draw_run_curves(run_dir)
    loss = final.get("loss")
    click.echo(f"trained {final.get('steps')} steps on {num_workers} Ray Train workers; final loss "
               f"{float('nan') if loss is None else loss:.4f}; drafter in {run_dir}/drafter")


if __name__ == "__main__":  # torchrun --nproc-per-node N -m pipeline.commands.train --store ... --out ...
    from pipeline.dependency_floors import refuse_old_dependencies

    refuse_old_dependencies()
    train()
