"""`beagle-pipeline train` in one process (or one torchrun rank): build a TrainConfig from defaults,
--config FILE and flags, then train. `pipeline.train_cli` adds the Ray Train path (--num-workers) on top."""
from __future__ import annotations

from typing import Any

import click

from beagle.train_config import TrainConfig, load_config_file


# The parameters of `train` that are not TrainConfig keys (the rest of its options override the config).
RUN_OPTIONS = ("stores", "run_dir", "config_file", "resume", "progress", "cache_dir", "verify_store")


def build_config(config_file: str | None, flags: dict[str, Any]) -> TrainConfig:
    """Defaults, then --config FILE, then the flags given; a bad value is a usage error naming it."""
    if flags.get("batch_tokens") is not None and flags.get("rank_batch_tokens") is not None:
        raise click.UsageError("--batch-tokens and --rank-batch-tokens both given; pass one (the global "
                               "batch, or each rank's)")
    try:
        base = load_config_file(config_file) if config_file else TrainConfig()
        return base.override(**flags)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from exc


def _layer_list(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated layer indices, e.g. 2,15,27") from None


@click.command("train")
@click.option("--store", "stores", multiple=True, required=True,
              help="Feature store (path or fsspec URL); repeat to train on several stores of one target.")
@click.option("--out", "run_dir", required=True, type=click.Path(file_okay=False),
              help="Run directory: metrics, checkpoints, drafter/ export, curves.png.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="TOML or JSON file with TrainConfig keys; flags given here override it.")
@click.option("--drafter", type=click.Choice(["beagle", "eagle2"]),
              help="Drafter to train: beagle, or the EAGLE-2 baseline (all epochs teacher-forced). [beagle]")
@click.option("--stage1-epochs", type=int, help="Epochs of stage 1 (block attention). [2]")
@click.option("--stage2-epochs", type=int, help="Epochs of stage 2 (training-time simulation). [2]")
@click.option("--max-steps", type=int, help="Stop after this many optimizer steps in total.")
@click.option("--window-size", type=int, help="Window size k. [5]")
@click.option("--simulation-steps", type=int, help="Stage-2 depths s <= k. [4]")
@click.option("--batch-tokens", type=int, help="Padded tokens per batch; under data parallelism the global "
                                               "batch, split over the ranks. [4096]")
@click.option("--rank-batch-tokens", type=int,
              help="Instead of --batch-tokens: padded tokens per data-parallel rank (the global batch is this "
                   "times the number of ranks; samples default to this length).")
@click.option("--max-length", type=int, help="Truncate samples to this many tokens. [batch-tokens]")
@click.option("--grad-accum", type=int,
              help="Gradient accumulation: split each batch's samples into G micro-batches, forward and backward "
                   "one at a time, one optimizer step per batch (same update, 1/G of the activation memory; "
                   "the paper's 16 x 2048 on one GPU: --batch-tokens 32768 --max-length 2048 --grad-accum 4). [1]")
@click.option("--lr", type=float, help="Peak learning rate. [3e-5]")
@click.option("--warmup-steps", type=int, help="Linear warm-up steps. [2000]")
@click.option("--noise-std", type=float, help="Key noise std as a fraction of the states' RMS. [0.2]")
@click.option("--regression-weight", type=float,
              help="Weight of the SmoothL1 regression of the drafted states next to the token loss (the "
                   "method's 10; 0 trains the token loss alone, see docs/training.md). [10]")
@click.option("--fuse-layers/--no-fuse-layers", default=None,
              help="Make true keys from a fusion of every layer the stores captured (extract --layers 8,16,-1), "
                   "EAGLE-3 style; the drafter still predicts and is scored on the last layer. [no]")
@click.option("--residual", type=click.Choice(["embedding", "state"]),
              help="Beagle's residual stream: the query's embedding (the paper's form), or the previous "
                   "position's state, the engine form that `export --format eagle3` serves in vLLM/SGLang "
                   "(docs/method.md §9; keys from the layers --key-layers names). [embedding]")
@click.option("--key-layers", callback=lambda ctx, param, value: _layer_list(value),
              help="With --residual state: the captured layers (HF hidden_states indices 0..n-1, the residual "
                   "stream entering decoder layer i) whose states make the keys, e.g. 2,15,27. [every captured "
                   "layer but -1]")
@click.option("--query-state/--no-query-state", default=None,
              help="With --residual state: the queries also read the previous state (EAGLE-3's q over [embedding; "
                   "state]; still one EAGLE-3 layer), not the embedding alone. [no]")
@click.option("--detach-feedback/--no-detach-feedback", default=None,
              help="Cut gradients through fed-back predicted states in stage 2. [no]")
@click.option("--vocab-chunk", type=int,
              help="Vocabulary rows per soft cross-entropy chunk. [1024 on a CPU, where the blocks then stay in "
                   "cache (training 1.6x faster than at 8192); 8192 on a GPU]")
@click.option("--draft-vocab", type=int,
              help="Train the token loss over the N most frequent predicted tokens only (0: all). Several "
                   "times faster on CPU; the export records them and `eval` drafts over the same. [0]")
@click.option("--checkpoint-every", type=int, help="Steps between checkpoints. [500]")
@click.option("--val-samples", type=int,
              help="Hold N samples of the stores out of training (chosen by --seed) and report their loss and "
                   "offline acceptance per depth and tau in metrics.jsonl; with --val-store, N of that store. "
                   "[0: no validation]")
@click.option("--val-store",
              help="Validate on this store (same target, other samples) instead of holding training samples out; "
                   "all of it unless --val-samples N.")
@click.option("--eval-every", type=int, help="Optimizer steps between validations; one also runs at the end. [500]")
@click.option("--device", help="auto, cpu, cuda or cuda:N. [auto]")
@click.option("--bf16/--no-bf16", default=None,
              help="bf16 autocast (weights and optimizer state stay fp32). [on where the hardware multiplies "
                   "bf16 natively: CUDA, or a CPU with AMX/AVX512-BF16]")
@click.option("--seed", type=int, help="Seed for init, batch order, offsets and noise. [0]")
@click.option("--cache-dir", type=click.Path(file_okay=False),
              help="Local folder caching the files read from remote (fsspec URL) stores.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--verify-store/--no-verify-store", default=True,
              help="Check each store file's checksum on first read; refuse a damaged store. [on]")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
def train(stores: tuple[str, ...], run_dir: str, config_file: str | None, resume: bool, progress: bool,
          cache_dir: str | None, verify_store: bool, **flags: Any) -> None:
    """Train a Beagle drafter on feature stores (stage 1, then stage 2) and export RUN/drafter/.

    Several processes: `torchrun --nproc-per-node N -m beagle.train_cli ...` or --num-workers N (Ray Train)."""
    from tqdm import tqdm

    from beagle.trainer import train as run_training
    from pipeline.store import StoreError

    config = build_config(config_file, flags)
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
        result = run_training(list(stores), run_dir, config, resume=resume, on_step=on_step, cache_dir=cache_dir,
                              verify_store=verify_store)
    except StoreError as exc:  # damaged, foreign or hostile store: one line naming the file
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    finally:
        if bar is not None:
            bar.close()
    final = result.final_metrics or {}
    held_out = "" if result.validation is None else (
        f"; held-out loss {result.validation['loss']:.4f}, tau {result.validation['tau']:.3f}")
    click.echo(f"trained {result.steps} steps; final loss {final.get('loss', float('nan')):.4f}{held_out}; "
               f"drafter in {result.run_dir / 'drafter'}")


if __name__ == "__main__":  # torchrun --nproc-per-node N -m beagle.train_cli --store ... --out ...
    train()
