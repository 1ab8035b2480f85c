"""`beagle-pipeline regenerate`: the click command; builds a RegenerateConfig, draws progress, prints the summary."""
from __future__ import annotations

from typing import Any

import click

from beagle.devices import DTYPES
from beagle.precision import AUTO_DTYPE
from pipeline.commands.engine_options import engine_options, vllm_config
from pipeline.commands.errors import as_click_error
from pipeline.commands.options import default_option
from pipeline.jobkit.cli import TqdmProgress, echo_summary
from pipeline.jobkit.ray_session import quiet_ray_loggers
from pipeline.regenerate.generation import GenerateConfig
from pipeline.regenerate.job import RegenerateConfig, run_regenerate


@click.command("regenerate")
@click.option("--model", "model_path", required=True, type=click.Path(),
              help="Local directory of the target (transformers format). The hub is never used.")
@click.option("--data", multiple=True, required=True, type=click.Path(),
              help="Prompts: conversations (`conversations`/`messages`; their answers are discarded), MT-Bench "
                   "`turns` or `prompt` records, in .jsonl, .json, .parquet or a datasets directory. Repeatable.")
@click.option("--out", required=True, help="Output JSONL of regenerated conversations, ready for `extract --data`.")
@default_option(GenerateConfig, "max_new_tokens", "--max-new-tokens", type=click.IntRange(min=1),
                help="Longest answer per turn, in tokens.")
@default_option(GenerateConfig, "max_prompt_length", "--max-prompt-length", type=click.IntRange(min=1),
                help="Longest prompt (history included); a record whose first prompt is longer is rejected, "
                   "later turns past it are skipped.")
@default_option(GenerateConfig, "max_turns", "--max-turns", type=click.IntRange(min=0),
                help="Answer only the first N user turns of each conversation (0 = all).")
@default_option(GenerateConfig, "temperature", "--temperature", type=click.FloatRange(min=0.0),
                help="0: greedy answers, what `eval --temperature 0` decodes; > 0 samples.")
@default_option(GenerateConfig, "top_p", "--top-p", type=click.FloatRange(0.0, 1.0),
                help="Nucleus sampling when --temperature > 0.")
@default_option(GenerateConfig, "seed", "--seed", type=int, help="Sampling seed (each chunk uses seed + chunk index).")
@default_option(GenerateConfig, "dtype", "--dtype", type=click.Choice([AUTO_DTYPE, *sorted(DTYPES)]),
                help="Model dtype while generating. auto: bfloat16 on GPUs (and when joining a cluster, --address) "
                     "and on CPUs that multiply it natively (AMX, AVX512-BF16); float32 on other CPUs, where bf16 "
                     "is emulated and generation ran 3x slower. The answers record the dtype used.")
@default_option(GenerateConfig, "batch_size", "--batch-size", type=click.IntRange(min=1),
                help="Conversations per generate call (hf); with --engine vllm, rows in flight (max_num_seqs).")
@engine_options(GenerateConfig, engine_help="hf: transformers `generate` in the actors; vllm: vllm.LLM (continuous "
                "batching, paged attention) in a worker process of the vLLM environment (see --vllm-python).")
@default_option(RegenerateConfig, "chunk_size", "--chunk-size", type=click.IntRange(min=1),
                help="Conversations per actor task; a crash loses at most the chunks in flight.")
@click.option("--num-workers", type=int, default=None,
              help="Generation actors. Default: one per GPU, or one CPU actor using all cores.")
@default_option(RegenerateConfig, "num_gpus_per_worker", "--num-gpus-per-worker", type=click.FloatRange(min=0),
                help="GPUs per actor.")
@click.option("--address", default=None, help="Ray cluster to join (default: start a local Ray).")
@click.option("--limit", type=int, default=None, help="Use only the first N usable records.")
@default_option(RegenerateConfig, "max_record_bytes", "--max-record-bytes", type=click.IntRange(min=1),
                help="Reject (as too_large, in the rejects file) any input record larger than this, unparsed.")
@click.option("--overwrite", is_flag=True, help="Replace an output (or unfinished work) from other inputs or settings.")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code shipped in the model directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def regenerate(model_path: str, data: tuple[str, ...], out: str, max_new_tokens: int, max_prompt_length: int,
               max_turns: int,
               temperature: float, top_p: float, seed: int, dtype: str, batch_size: int, chunk_size: int,
               num_workers: int | None, num_gpus_per_worker: float, address: str | None, limit: int | None,
               max_record_bytes: int, overwrite: bool, trust_remote_code: bool, no_progress: bool, engine: str,
               **vllm_options: Any) -> None:
    """Let the target answer the prompts itself, for self-distillation.

    A drafter is measured on the target's own answers, so it learns most from them: run this, then
    `extract --data OUT` on its output. Greedy by default, like `eval`. Rerun the same command after a
    crash: finished chunks are kept.
    """
    quiet_ray_loggers()
    generate = GenerateConfig(model_path=model_path, dtype=dtype, max_new_tokens=max_new_tokens,
                              max_prompt_length=max_prompt_length, max_turns=max_turns, batch_size=batch_size,
                              temperature=temperature,
                              top_p=top_p, seed=seed, trust_remote_code=trust_remote_code, engine=engine,
                              vllm=vllm_config(vllm_options))
    config = RegenerateConfig(generate=generate, data=tuple(data), out=out, limit=limit,
                              max_record_bytes=max_record_bytes, chunk_size=chunk_size,
                              num_workers=num_workers, num_gpus_per_worker=num_gpus_per_worker, address=address,
                              overwrite=overwrite)
    progress = TqdmProgress(desc="regenerate", unit="conv", enabled=not no_progress)
    try:
        summary = run_regenerate(config, progress=progress)
    except ValueError as error:  # a setting exits 2, data or state 1 (pipeline/commands/errors.py)
        raise as_click_error(error) from None
    finally:
        progress.close()
    echo_summary(summary, out)
