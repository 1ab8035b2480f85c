"""`beagle-pipeline regenerate`: the click command; builds a RegenerateConfig, draws progress, prints the summary."""
from __future__ import annotations

import click

from beagle.devices import DTYPES

from pipeline.jobkit.cli import TqdmProgress, echo_summary
from pipeline.jobkit.ray_session import quiet_ray_loggers
from pipeline.jobkit.records import DEFAULT_MAX_RECORD_BYTES
from pipeline.regenerate.generation import GenerateConfig
from pipeline.regenerate.job import RegenerateConfig, run_regenerate


@click.command("regenerate")
@click.option("--model", "model_path", required=True, type=click.Path(),
              help="Local directory of the target (transformers format). The hub is never used.")
@click.option("--data", multiple=True, required=True, type=click.Path(),
              help="Prompts: conversations (`conversations`/`messages`; their answers are discarded), MT-Bench "
                   "`turns` or `prompt` records, in .jsonl, .json, .parquet or a datasets directory. Repeatable.")
@click.option("--out", required=True, help="Output JSONL of regenerated conversations, ready for `extract --data`.")
@click.option("--max-new-tokens", default=512, show_default=True, help="Longest answer per turn, in tokens.")
@click.option("--max-prompt-length", default=2048, show_default=True,
              help="Longest prompt (history included); a record whose first prompt is longer is rejected, "
                   "later turns past it are skipped.")
@click.option("--max-turns", default=0, show_default=True, type=click.IntRange(min=0),
              help="Answer only the first N user turns of each conversation (0 = all).")
@click.option("--temperature", default=0.0, show_default=True,
              help="0: greedy answers, what `eval --temperature 0` decodes; > 0 samples.")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling when --temperature > 0.")
@click.option("--seed", default=0, show_default=True, help="Sampling seed (each chunk uses seed + chunk index).")
@click.option("--dtype", default="bfloat16", show_default=True,
              type=click.Choice(sorted(DTYPES)), help="Model dtype while generating.")
@click.option("--batch-size", default=32, show_default=True, help="Conversations per generate call.")
@click.option("--chunk-size", default=128, show_default=True,
              help="Conversations per actor task; a crash loses at most the chunks in flight.")
@click.option("--num-workers", type=int, default=None,
              help="Generation actors. Default: one per GPU, or one CPU actor using all cores.")
@click.option("--num-gpus-per-worker", type=float, default=1.0, show_default=True, help="GPUs per actor.")
@click.option("--address", default=None, help="Ray cluster to join (default: start a local Ray).")
@click.option("--limit", type=int, default=None, help="Use only the first N usable records.")
@click.option("--max-record-bytes", type=click.IntRange(min=1), default=DEFAULT_MAX_RECORD_BYTES, show_default=True,
              help="Reject (as too_large, in the rejects file) any input record larger than this, unparsed.")
@click.option("--overwrite", is_flag=True, help="Replace an output (or unfinished work) from other inputs or settings.")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code shipped in the model directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def regenerate(model_path: str, data: tuple[str, ...], out: str, max_new_tokens: int, max_prompt_length: int,
               max_turns: int,
               temperature: float, top_p: float, seed: int, dtype: str, batch_size: int, chunk_size: int,
               num_workers: int | None, num_gpus_per_worker: float, address: str | None, limit: int | None,
               max_record_bytes: int, overwrite: bool, trust_remote_code: bool, no_progress: bool) -> None:
    """Let the target answer the prompts itself, for self-distillation.

    A drafter is measured on the target's own answers, so it learns most from them: run this, then
    `extract --data OUT` on its output. Greedy by default, like `eval`. Rerun the same command after a
    crash: finished chunks are kept.
    """
    quiet_ray_loggers()
    generate = GenerateConfig(model_path=model_path, dtype=dtype, max_new_tokens=max_new_tokens,
                              max_prompt_length=max_prompt_length, max_turns=max_turns, batch_size=batch_size,
                              temperature=temperature,
                              top_p=top_p, seed=seed, trust_remote_code=trust_remote_code)
    config = RegenerateConfig(generate=generate, data=tuple(data), out=out, limit=limit,
                              max_record_bytes=max_record_bytes, chunk_size=chunk_size,
                              num_workers=num_workers, num_gpus_per_worker=num_gpus_per_worker, address=address,
                              overwrite=overwrite)
    progress = TqdmProgress(desc="regenerate", unit="conv", enabled=not no_progress)
    try:
        summary = run_regenerate(config, progress=progress)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    finally:
        progress.close()
    echo_summary(summary, out)
