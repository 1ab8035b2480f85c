"""`beagle-pipeline extract`: the click command; builds an ExtractConfig, draws progress, prints the summary."""
from __future__ import annotations

from typing import Any

import click

from beagle.devices import DTYPES
from pipeline.commands.engine_options import engine_options, vllm_config
from pipeline.commands.errors import as_click_error
from pipeline.commands.options import default_option, field_default
from pipeline.extract.pipeline import ExtractConfig, dry_run, run_extract
from pipeline.jobkit.cli import TqdmProgress, echo_summary
from pipeline.jobkit.ray_session import quiet_ray_loggers
from pipeline.store.format import COMPRESSIONS


def _layers(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None  # the default capture, resolved for the target's depth at prepare time
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated integers, e.g. -1 or 4,8,-1") from None


def _forms(value: str | None) -> tuple[str, ...] | None:
    """`--layers-for a,b`: drafter forms of beagle/registry.py, each checked (a usage error names them all)."""
    if value is None:
        return None
    from beagle.registry import FORMS

    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in FORMS]
    if unknown or not names:
        raise click.BadParameter(f"{value!r}: name drafter forms, comma-separated, of {', '.join(FORMS)}")
    return names


@click.command("extract")
@click.option("--model", "model_path", required=True, type=click.Path(),
              help="Local directory of the target (transformers format). The hub is never used.")
@click.option("--data", multiple=True, required=True, type=click.Path(),
              help="Input: .jsonl, .json (array), .parquet or a datasets save_to_disk directory. Repeatable.")
@click.option("--out", required=True, help="Store to write: a local path or an fsspec URL.")
@click.option("--layers", default=None, callback=_layers,
              help="Hidden-state layers to store (HF hidden_states index i = the residual stream entering decoder "
                   "layer i, 0 = embeddings; -1 = after the final norm, what the LM head reads; -2 = the last "
                   "layer's input). Default: EAGLE-3's aux layers 2, n//2, n-3 of an n-layer target, plus -1: "
                   "one store trains every form (the paper's Beagle keys on -1; train --residual state and every "
                   "EAGLE-3 export, SGLang's included, key on the three aux layers). Each layer costs d x 2 bytes "
                   "per token in bf16 (docs/extract.md). Comma-separated.")
@click.option("--layers-for", default=None, callback=lambda ctx, param, value: _forms(value), metavar="FORMS",
              help="Instead of --layers: capture what these drafter forms need, comma-separated (beagle, "
                   "beagle-state, eagle2: their rows in beagle/registry.py), e.g. `--layers-for beagle` stores -1 "
                   "alone. [every form]")
@default_option(ExtractConfig, "max_length", "--max-length", type=click.IntRange(min=1),
                help="Truncate samples at this many tokens.")
@default_option(ExtractConfig, "dtype", "--dtype", type=click.Choice(sorted(DTYPES)), help="Model and stored dtype.")
@click.option("--store-dtype", type=click.Choice(["bfloat16", "float8_e4m3", "int8"]), default=None,
              help="Store the states in another dtype than --dtype: int8 (symmetric, per-token absmax) or "
                   "float8_e4m3, one byte a value plus a float32 scale a token (with --compression zstd an int8 "
                   "store is ~0.3x a bf16 one; measured τ in docs/benchmarks.md); or bfloat16 from --dtype "
                   "float32, for a CPU that emulates bf16 (no AMX or AVX512-BF16): float32's speed there, "
                   "bf16's bytes. [--dtype]")
@default_option(ExtractConfig, "compression", "--compression", type=click.Choice(sorted(COMPRESSIONS)),
                help="zstd (level 1, zarr's own codec): smaller files (about 0.75x for bf16, 0.7x for int8 codes), "
                   "read through zarr instead of a memory map.")
@click.option("--batch-tokens", type=click.IntRange(min=1), default=None,
              help="Padded tokens per forward batch (rows x longest sample). [16384 on GPUs; 4096 on CPUs, "
                   "where larger batches forward slower: their activations leave the caches]")
@click.option("--num-workers", type=int, default=None,
              help="Forward actors. Default: one per GPU, or one CPU actor using all cores.")
@default_option(ExtractConfig, "num_gpus_per_worker", "--num-gpus-per-worker", type=click.FloatRange(min=0),
                help="GPUs per forward actor; > 1 for targets that do not fit one GPU (with --device-map auto).")
@click.option("--device-map", type=click.Choice(["auto"]), default=None,
              help="auto: spread the target's layers over the actor's GPUs (needs accelerate).")
@engine_options(ExtractConfig, engine_help="hf: a transformers forward with hooks in the actors; vllm: vLLM's "
                "extract_hidden_states method in a worker process of the vLLM environment (see --vllm-python; "
                "tensor/pipeline parallel targets). The engine is part of the store's identity: a store is never "
                "resumed with the other one.")
@click.option("--address", default=None, help="Ray cluster to join (default: start a local Ray).")
@click.option("--limit", type=int, default=None, help="Use only the first N usable records.")
@default_option(ExtractConfig, "max_record_bytes", "--max-record-bytes", type=click.IntRange(min=1),
                help="Reject (as too_large, in the rejects file) any input record larger than this, unparsed.")
@default_option(ExtractConfig, "max_turns", "--max-turns", type=click.IntRange(min=1),
                help="Reject (as too_many_turns) any conversation of more turns than this, before tokenizing: "
                   "finding its loss mask could take minutes.")
@default_option(ExtractConfig, "samples_per_shard", "--samples-per-shard", type=click.IntRange(min=1),
                help="Samples per store shard.")
@click.option("--overwrite", is_flag=True,
              help="If --out holds a store (or unfinished store) built from other inputs or settings, DELETE it "
                   "before building this one (only the files it lists: a folder holding anything else is "
                   "refused). A store of these same inputs is never deleted: it is kept if complete, resumed "
                   "if not.")
@click.option("--dry-run", is_flag=True, help="Tokenize only; print token count and estimated store size.")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code shipped in the model directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def extract(model_path: str, data: tuple[str, ...], out: str, layers: tuple[int, ...],
            layers_for: tuple[str, ...] | None, max_length: int,
            dtype: str, store_dtype: str | None, compression: str, batch_tokens: int | None, num_workers: int | None, num_gpus_per_worker: float,
            device_map: str | None, address: str | None, limit: int | None, max_record_bytes: int,
            max_turns: int, samples_per_shard: int, overwrite: bool, dry_run: bool, trust_remote_code: bool,
            no_progress: bool, engine: str, **vllm_options: Any) -> None:
    """Run the target over conversations and store its hidden states for drafter training.

    Rerun the same command after a crash: committed shards are kept and the rest is redone.
    """
    import errno

    from pipeline.store import StoreError

    if not dry_run:
        quiet_ray_loggers()

    config = ExtractConfig(model_path=model_path, data=tuple(data), out=out, layers=layers, layers_for=layers_for,
                           max_length=max_length,
                           dtype=dtype, store_dtype=store_dtype, compression=compression,
                           batch_tokens=batch_tokens, num_workers=num_workers,
                           num_gpus_per_worker=num_gpus_per_worker, device_map=device_map, address=address,
                           limit=limit, max_record_bytes=max_record_bytes, max_turns=max_turns, overwrite=overwrite,
                           trust_remote_code=trust_remote_code, samples_per_shard=samples_per_shard,
                           engine=engine, vllm=vllm_config(vllm_options))
    progress = TqdmProgress(desc="extract", unit="record", enabled=not no_progress)
    try:
        summary = dry_run_fn(config) if dry_run else run_extract(config, progress=progress)
    except (ValueError, StoreError) as error:  # a setting exits 2, data or state 1 (pipeline/commands/errors.py)
        raise as_click_error(error) from None
    except OSError as error:  # disk full or over quota: committed shards are kept, no manifest is written
        if dry_run or error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise click.ClickException(
            f"writing {out} failed: {error.strerror or error}; the store is unfinished (no manifest.json, "
            "readers refuse it); free space and rerun the same command to resume") from None
    finally:
        progress.close()
    echo_summary(summary, out)


dry_run_fn = dry_run
