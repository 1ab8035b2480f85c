"""`beagle-pipeline eval`: speculative decoding with a trained drafter against plain decoding."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from beagle.devices import DTYPES
from beagle.decoding.tree import DraftConfig
from pipeline.commands.acceptance_plots import group_chart_path, plot_acceptance, plot_groups
from pipeline.commands.errors import reports_errors
from pipeline.commands.options import default_option
from pipeline.jobkit.rejects import count_reasons, format_reasons

HALF_DTYPES = ("bfloat16", "float16")  # where greedy equality is reported, not enforced (see --strict)

logger = logging.getLogger(__name__)


def _format_depths(values: list[float | None], attempts: list[int], few: int) -> str:
    """`d1=0.81 (n=311)  d3=1.00 (n=4)*`: each rate with its attempts, * where they are fewer than `few`."""
    return "  ".join(f"d{depth}={'-' if value is None else f'{value:.2f}'} (n={tried})"
                     + ("*" if 0 < tried < few else "")
                     for depth, (value, tried) in enumerate(zip(values, list(attempts) + [0] * len(values)), start=1))


def _echo_groups(report: dict) -> None:
    """One line per group: prompts, τ, speedup, α per depth with attempts."""
    by = report["by"]
    few = report["few_attempts"]
    width = max(len(name) for name in by["groups"])
    click.echo(f"by {by['field']} (α per depth with its attempts; * fewer than {few}: rough):")
    for name, group in by["groups"].items():
        click.echo(f"  {name:<{width}}  {group['prompts']:>3} prompts  τ {group['acceptance_length']:.2f}  "
                   f"speedup {group['speedup']:.2f}x  "
                   + _format_depths(group["per_depth_acceptance"], group["per_depth_attempts"], few))


def _check_stores(stores: list[str]) -> None:
    """Refuse a damaged or foreign store before counting tokens in it: identity and file sizes at open,
    and the checksum of every sample table (the only part of a store eval reads)."""
    from pipeline.store import open_store

    for url in stores:
        open_store(url, verify="first-read").lengths  # reading the tables hashes them first


@click.command("eval")
@click.option("--model", "model_path", required=True, type=click.Path(exists=True, file_okay=False),
              help="Local HF directory of the target causal LM.")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="RUN/drafter directory written by `beagle-pipeline train`.")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(exists=True),
              help="Prompts in any input format `extract` reads (JSONL, JSON array, Parquet, `datasets` folder): "
                   "MT-Bench question.jsonl, or records with `prompt`, `messages`, `conversations` or `text`. "
                   "Records that cannot be asked are skipped and reported.")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--chain/--tree", default=False, show_default=True,
              help="Top-1 chain of --depth tokens, or the EAGLE-2 dynamic tree.")
@default_option(DraftConfig, "depth", "--depth", type=click.IntRange(min=1), help="Drafter steps per round.")
@default_option(DraftConfig, "top_k", "--top-k", type=click.IntRange(min=1),
                help="Tree: nodes expanded per depth, children per expanded node.")
@default_option(DraftConfig, "total_tokens", "--total-tokens", type=click.IntRange(min=1),
                help="Tree: drafted tokens the target verifies per round.")
@default_option(DraftConfig, "temperature", "--temperature", type=click.FloatRange(min=0.0),
                help="0 = greedy (outputs must match plain decoding); > 0 = speculative sampling.")
@default_option(DraftConfig, "min_confidence", "--min-confidence", type=click.FloatRange(0.0, 1.0),
                help="Greedy only: draft a token only while the drafter gives its whole path at least this "
                     "probability (0 = the fixed-size chain/tree). Stops a weak drafter from costing time.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Use only the first N prompts.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the summary here.")
@click.option("--answers", "answers_path", default=None, type=click.Path(dir_okay=False),
              help="Write both answers to every turn (plain and speculative, decoded) here as JSONL, to read "
                   "side by side.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write a per-depth acceptance bar plot (PNG).")
@click.option("--by", "group_field", default="category", show_default=True, metavar="FIELD",
              help="Also report τ, α per depth and speedup per value of this record field (MT-Bench's "
                   "category; '' for none), in the text and --json; with --json, a bar chart per group is "
                   "written beside it (JSON-NAME-by-FIELD.png). Records without the field form one group.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(sorted(DTYPES)),
              help="Target and drafter dtype. Compare outputs in float32: bf16 is not deterministic enough.")
@click.option("--drafter-dtype", default=None, type=click.Choice(sorted(DTYPES)),
              help="Drafter dtype if not --dtype (bf16 halves its LM-head reads; the target still decides).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1 ...")
@click.option("--draft-vocab", default=None, type=click.IntRange(min=0),
              help="Score only the N most frequent predicted tokens in the drafter's LM head (0 = all). "
                   "Default: the vocabulary the drafter was trained on (`train --draft-vocab`), else all.")
@click.option("--draft-vocab-store", multiple=True,
              help="Store(s) to count token frequencies in (default: the stores in the drafter's config.json).")
@click.option("--allow-other-target-weights", is_flag=True,
              help="Evaluate even when --model's weights are not those the drafter was trained on (it records "
                   "their sha256), e.g. on a fine-tune of that target. Outputs stay the target's own (verification "
                   "decides every token); the risk is speed: a drafter trained on other states may be accepted "
                   "rarely, and its τ and speedup then describe the mismatch, not the drafter.")
@click.option("--trust-remote-code", is_flag=True,
              help="Run the model code shipped in --model's folder (a target that `extract --trust-remote-code` "
                   "read). Off by default: that code runs with your permissions.")
@click.option("--no-concat", is_flag=True, help="Drafted states are not fed back as keys (docs/method.md §5.2).")
@click.option("--strict/--no-strict", default=None,
              help="Greedy: exit 1 when any answer differs from plain decoding. [on in float32; off in bfloat16 "
                   "and float16, where differing answers are counted and reported: half precision rounds a "
                   "one-token and a many-token pass differently]")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@reports_errors
def evaluate(model_path, drafter_dir, prompts_path, max_new_tokens, chain, depth, top_k, total_tokens,
             temperature, min_confidence, seed, limit, json_path, answers_path, plot_path, group_field, dtype, drafter_dtype, device, draft_vocab,
             draft_vocab_store, allow_other_target_weights, trust_remote_code, no_concat, strict,
             no_progress) -> None:
    """Speculative decoding with a Beagle drafter vs plain decoding of the same target, same prompts.

    Prints τ (tokens per target pass), acceptance per depth, tokens/s of both, the speedup and peak
    memory. With --temperature 0 any output that differs from plain decoding is reported, and in float32
    (or with --strict) the command exits with status 1.
    """
    import torch
    from tqdm import tqdm

    from beagle.decoding.draft_vocab import select_draft_vocabulary
    from beagle.decoding.evaluation import evaluate_prompts
    from beagle.decoding.loading import load_drafter_for, load_target
    from beagle.devices import pick_device
    from beagle.prompts import eos_token_ids, load_prompts
    from beagle.drafter_folder import CONFIG_NAME, read_drafter_meta
    from beagle.registry import form_named
    from beagle.target_model import TargetSpec

    if draft_vocab:
        _check_stores(list(draft_vocab_store))  # before loading any model: fail fast on a bad store
    drafter_config = Path(drafter_dir) / CONFIG_NAME
    if drafter_config.is_file():  # before loading the target: the form's row says which drafting it can do
        form_named(read_drafter_meta(drafter_config).get("drafter_type"),
                   where=f"{drafter_config}: drafter_type").check_decoding(not no_concat)
    config = (DraftConfig.chain(depth, temperature, not no_concat, min_confidence) if chain else
              DraftConfig(depth=depth, top_k=top_k, total_tokens=total_tokens, temperature=temperature,
                          concatenate=not no_concat, min_confidence=min_confidence))
    loaded = load_prompts(prompts_path, limit, skip_rejects=True, group_by=group_field or None)
    items = loaded.items
    if loaded.rejects:
        first = loaded.rejects[0]
        click.echo(f"skipped {len(loaded.rejects)} prompt record(s) that cannot be asked "
                   f"({format_reasons(count_reasons(loaded.rejects))}); the first: {first['source']} "
                   f"{'line ' + str(first['line']) if 'line' in first else 'record ' + str(first['index'])}: "
                   f"{first['detail']}", err=True)
    torch_device = pick_device(device)
    torch.manual_seed(seed)
    model, tokenizer = load_target(TargetSpec(model_path, dtype, trust_remote_code), device=torch_device)
    drafter, meta = load_drafter_for(drafter_dir, model, drafter_dtype or dtype, torch_device,
                                     allow_other_weights=allow_other_target_weights)
    eos = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    if draft_vocab and not draft_vocab_store:
        _check_stores(list(meta.get("stores") or []))  # the training stores it will count tokens in
    drafter, vocabulary_note = select_draft_vocabulary(drafter, meta, draft_vocab, list(draft_vocab_store), eos)
    if vocabulary_note:
        click.echo(vocabulary_note)

    if not eos:
        logger.warning("no EOS id in the tokenizer or generation_config; answers stop at --max-new-tokens")
    progress = (lambda xs: xs) if no_progress else (lambda xs: tqdm(xs, desc="prompts", unit="prompt"))
    summary = evaluate_prompts(model, drafter, tokenizer, items, config, max_new_tokens, eos, seed, progress,
                               keep_answers=answers_path is not None, group_field=group_field or None)

    shape = f"chain depth {depth}" if chain else f"tree depth {depth} top-k {top_k} total {total_tokens}"
    if min_confidence > 0:
        shape += f" min-confidence {min_confidence:g}"
    report = summary.to_json()
    report["rejected_prompts"] = loaded.rejects
    click.echo(f"prompts: {summary.num_prompts}  max new tokens: {max_new_tokens}  draft: {shape}"
               f"{' no-concat' if no_concat else ''}  temperature: {temperature}  dtype: {dtype}  "
               f"device: {torch_device}")
    click.echo(f"acceptance length τ: {summary.acceptance_length:.2f} tokens per target pass")
    click.echo(f"acceptance per depth: {_format_depths(report['per_depth_acceptance'], report['per_depth_attempts'], report['few_attempts'])}")
    click.echo(f"tokens/s: baseline {report['tokens_per_second']['baseline']:.1f}  "
               f"speculative {report['tokens_per_second']['speculative']:.1f}  speedup {summary.speedup:.2f}x")
    click.echo("peak memory (MiB): " + "  ".join(f"{k} {v:.0f}" for k, v in summary.peak_memory_mb.items()))
    if report["by"]:
        _echo_groups(report)
    title = f"{Path(drafter_dir).parent.name or drafter_dir}: τ={summary.acceptance_length:.2f}, {shape}"
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if report["by"]:
            chart = group_chart_path(Path(json_path), group_field)
            plot_groups(report["by"]["groups"], chart, title, few=report["few_attempts"])
            click.echo(f"acceptance by {group_field}: {chart}")
    if answers_path:
        Path(answers_path).parent.mkdir(parents=True, exist_ok=True)
        Path(answers_path).write_text("".join(json.dumps(answer, ensure_ascii=False) + "\n"
                                              for answer in summary.answers), encoding="utf-8")
    if plot_path:
        plot_acceptance(report["per_depth_acceptance"], report["per_depth_attempts"], Path(plot_path), title,
                        few=report["few_attempts"])
    if temperature == 0:
        _report_greedy_equality(summary, dtype, strict)


def _report_greedy_equality(summary, dtype: str, strict: bool | None) -> None:
    """Greedy speculative decoding must reproduce plain decoding. In float32 a difference is a bug (exit 1).
    In half precision a one-token pass and a many-token pass round differently, which flips an argmax now
    and then (docs/eval.md): there differences are counted and reported unless --strict."""
    if not summary.mismatches:
        click.echo("outputs match plain greedy decoding token for token")
        return
    strict = dtype not in HALF_DTYPES if strict is None else strict
    for line in summary.mismatches:
        click.echo(f"{'MISMATCH' if strict else 'differs'} {line}", err=True)
    differing = f"{len(summary.mismatches)} of {summary.answers_compared} answer(s) differ from plain greedy decoding"
    if strict:
        click.echo(differing, err=True)
        sys.exit(1)
    click.echo(f"{differing} in {dtype} (half-precision rounding, not checked; check exactness with "
               "--dtype float32, or fail here with --strict)")
