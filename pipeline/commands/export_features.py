"""`beagle-pipeline export-features`: a feature store as another trainer's offline data (beagle/feature_export.py,
beagle/specforge_features.py)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.commands.errors import reports_errors

if TYPE_CHECKING:
    from pipeline.store import FeatureStore


@click.command("export-features")
@click.argument("store")
@click.option("--format", "format_", type=click.Choice(["speculators", "specforge"]), default="speculators",
              show_default=True,
              help="speculators: what `python -m speculators.train --data-path OUT` reads (one "
                   "hs_<i>.safetensors per sample, a datasets folder, token_freq.pt). specforge: SpecForge's "
                   "offline EAGLE-3 samples (rows_*/data_<i>.ckpt) and a run config for `specforge train`.")
@click.option("--model", "model_path", required=True, type=click.Path(exists=True, file_okay=False),
              help="The target the store was extracted from (its local folder). Its weights must hash to the "
                   "store's; only its final norm is read (speculators wants the last state before it), and "
                   "SpecForge's run config names it.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="The folder to write (it appears whole when done; a rerun resumes an interrupted one).")
@click.option("--force", is_flag=True, help="Replace an earlier export-features output at --out (nothing else).")
@click.option("--no-verify", is_flag=True, help="Skip recomputing the store's checksums first.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bars.")
@reports_errors
def export_features(store: str, format_: str, model_path: str, out: str, force: bool, no_verify: bool,
                    no_progress: bool) -> None:
    """Write STORE in another trainer's offline format, without running the target again.

    \b
    The store's checksums are verified first. For speculators the store needs -1 and
    at least one aux layer, for SpecForge -1 and exactly three (extract's default
    --layers: EAGLE-3's three and -1). Then:
      python -m speculators.train --verifier-name-or-path MODEL --data-path OUT \\
          --target-layer-ids <as printed> --on-missing raise
      specforge train --config OUT/specforge_eagle3.json [output_dir=DIR ...]
    """
    from tqdm import tqdm

    from beagle.feature_export import check_replaceable, export_speculators
    from beagle.target_model import read_final_norm, weights_sha256
    from pipeline.store import open_store
    from pipeline.store.verify import verify_store

    check_replaceable(Path(out).resolve(), force)
    opened = open_store(store)
    _check_layers(format_, opened)  # before the checksums: a store of the wrong layers is refused at once
    if not no_verify:
        with tqdm(unit="B", unit_scale=True, desc="verify", disable=no_progress or None, file=sys.stderr) as bar:
            report = verify_store(store, progress=bar.update)
        if not report.ok:
            raise ValueError(f"{store} fails verification ({report.problems[0]}); run `beagle-pipeline verify "
                             f"{store}` for every problem, and re-extract or restore it")
    expected = (opened.target or {}).get("weights_sha256")
    if expected and weights_sha256(model_path) != expected:
        raise ValueError(f"--model {model_path}: its weights are not the ones {store} was extracted from "
                         f"(store target {opened.target.get('name')!r}); pass that target's folder")
    norm = read_final_norm(model_path) if format_ == "speculators" else None
    with tqdm(total=len(opened), unit="sample", desc="export", disable=no_progress or None, file=sys.stderr) as bar:
        if format_ == "specforge":
            from beagle.specforge_features import export_specforge

            result = export_specforge(store, out, target=model_path, force=force, progress=bar.update)
            command = ["specforge", "train", "--config", str(result.config)]
        else:
            result = export_speculators(store, out, final_norm=norm, force=force,
                                        progress=bar.update, dataset_progress=not no_progress)
            command = ["python", "-m", "speculators.train", "--verifier-name-or-path",
                       str(Path(model_path).resolve()), "--data-path", str(result.out), "--target-layer-ids",
                       *map(str, result.target_layer_ids), "--on-missing", "raise"]
    resumed = f" ({result.resumed} kept from an interrupted run)" if result.resumed else ""
    skipped = f"; {result.skipped} holding NaN left out" if result.skipped else ""
    click.echo(f"wrote {result.samples} samples, {result.tokens:,} tokens{resumed}{skipped} to {result.out}")
    click.echo(f"train with: {shlex.join(command)}")


def _check_layers(format_: str, opened: FeatureStore) -> None:
    """A one-line ValueError when the store lacks the layers `format_`'s trainer reads (naming the fix)."""
    from beagle.feature_export import aux_layers_of
    from beagle.specforge_features import specforge_layer_ids

    if format_ == "specforge":
        architecture = (opened.target or {}).get("architecture") or {}
        specforge_layer_ids(opened.layers, architecture.get("num_hidden_layers"))
    else:
        aux_layers_of(opened.layers)
