"""`beagle-pipeline export`: a trained drafter in a serving engine's format (beagle/engine_export.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import click

from beagle.devices import DTYPES
from beagle.registry import EXPORT_FORMATS
from pipeline.commands.errors import reports_errors


def _drafter_folder(run: Path) -> tuple[Path, dict]:
    """(the drafter folder, the run's run_config.json or {}) for RUN = a run directory or its drafter/."""
    for folder, run_dir in ((run / "drafter", run), (run, run.parent)):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            run_config = run_dir / "run_config.json"
            return folder, json.loads(run_config.read_text(encoding="utf-8")) if run_config.is_file() else {}
    raise click.ClickException(f"{run} holds no drafter (config.json + model.safetensors, or drafter/ with them); "
                               "pass a RUN directory written by `beagle-pipeline train`, or its drafter/ folder")


def _target(target_dir: str | None, meta: dict, run_config: dict):
    """The target's facts and head: from --target, else from the first training store that opens."""
    from beagle.engine_export import target_from_model_dir, target_from_store

    if target_dir is not None:
        target = target_from_model_dir(target_dir)
        trained_for = (meta.get("target") or {}).get("config_sha256")
        actual = hashlib.sha256((Path(target_dir) / "config.json").read_bytes()).hexdigest()
        if trained_for and trained_for != actual:
            click.echo(f"warning: the drafter was trained on a target whose config.json differs from "
                       f"{target_dir}/config.json (sha256 {trained_for[:12]} vs {actual[:12]})", err=True)
        return target
    stores = list(meta.get("stores") or run_config.get("stores") or [])
    trained_on = set(meta.get("dataset_ids") or run_config.get("dataset_ids") or [])
    problems = []
    for url in stores:
        try:
            found = _store_identity(url)
            if trained_on and found not in trained_on:  # another store now at the recorded path
                problems.append(f"{url} is now another store (dataset_id {found[:12]}; the drafter trained on "
                                f"{', '.join(sorted(i[:12] for i in trained_on))})")
                continue
            return target_from_store(url)
        except Exception as error:  # a moved or remote store: say why, try the next one
            problems.append(f"{url}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
    reason = "; ".join(problems) if problems else "the drafter's config.json lists no training store"
    raise click.ClickException(f"no --target given and no training store opens ({reason}); pass --target "
                               "TARGET_DIR, the target model folder")


def _store_identity(url: str) -> str:
    """The dataset_id of the store at `url` (its manifest only)."""
    from pipeline.store import open_store

    return open_store(url).dataset_id


@click.command("export")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--format", "fmt", default="eagle3", show_default=True,
              type=click.Choice(list(EXPORT_FORMATS)),
              help="; ".join(f"{f.name}: {f.summary}" for f in EXPORT_FORMATS.values()) + ".")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The folder to write (built aside and renamed into place).")
@click.option("--target", "target_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="The target model folder: its embedding and LM head are read from it, and it is recorded as "
                   "the verifier path. Default: the head and facts of the drafter's training store (then no "
                   "verifier path is recorded: speculators' loader needs one, vLLM and SGLang do not).")
@click.option("--speculative-tokens", default=3, show_default=True, type=click.IntRange(min=1),
              help="EAGLE-3: the draft length written into the proposal method (an engine may override it).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(sorted(DTYPES)),
              help="Dtype of the exported weights (d2t/t2d stay int64/bool).")
@click.option("--embed-tokens/--no-embed-tokens", default=True, show_default=True,
              help="Write the target's embedding into the export. vLLM and SGLang share the target's own "
                   "without it (saving V x d values); speculators 0.9.0 needs it (it leaves a missing one "
                   "uninitialised).")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@reports_errors
def export(run, fmt, out_dir, target_dir, speculative_tokens, dtype, embed_tokens, force) -> None:
    """Write the drafter of RUN (a run directory or its drafter/ folder) in a serving engine's format.

    \b
    eagle3         the engine-form Beagle (train --residual state) as one EAGLE-3 layer: config.json with
                   speculators_config, model.safetensors with layers.0.*, fc, norm, lm_head (+ d2t/t2d for a
                   reduced draft vocabulary). vLLM: method "eagle3".
    eagle3-sglang  the same weights as midlayer.* with a flat LlamaForCausalLMEagle3 config (SGLang ids).
    eagle          the EAGLE-2 baseline (train --drafter eagle2) for vLLM's method "eagle".
    native         a copy of the drafter folder, for `beagle-pipeline eval`.

    Anything the engine would compute differently is refused with the reason: an embedding-residual Beagle
    (retrain with --residual state), an EAGLE-2 fc bias or draft vocabulary vLLM's EAGLE cannot hold, a key
    layer the engine cannot read. See docs/engine-export.md.
    """
    from beagle.devices import torch_dtype
    from beagle.drafter_folder import WEIGHTS_ENTRY, read_drafter_meta, read_weights
    from beagle.registry import form_named, resolve

    drafter_dir, run_config = _drafter_folder(run)
    meta = read_drafter_meta(drafter_dir / "config.json")
    form = form_named(meta.get("drafter_type"), where=f"{drafter_dir / 'config.json'}: drafter_type")
    export_format = form.export_format(fmt)  # the form's row says which formats it can be written in
    read_weights(drafter_dir / "model.safetensors", check_only=True,  # damage is found before any format copies it
                 checksum=meta.get(WEIGHTS_ENTRY))
    options = {"embed_tokens": embed_tokens, "dtype": torch_dtype(dtype), "speculative_tokens": speculative_tokens}
    options = {name: options[name] for name in export_format.takes} | export_format.fixed
    destination = (drafter_dir, _target(target_dir, meta, run_config), out_dir) if export_format.needs_target \
        else (drafter_dir, out_dir)
    written = resolve(export_format.writer)(*destination, replace=force, **options)
    click.echo(f"exported {form.name} drafter {drafter_dir} as {fmt} to {written}")
    click.echo("  serve with " + export_format.serve_hint.format(out=written, k=speculative_tokens))
