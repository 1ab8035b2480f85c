"""The store commands: `beagle-pipeline info`, `verify`, `merge` and `ls`."""
from __future__ import annotations

import errno
import json
import sys

import click

from pipeline.commands.errors import reports_errors
from pipeline.store.errors import StoreError


def _human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def info_facts(manifest: dict) -> dict:
    """The facts `info --json` prints: stable keys other tools may rely on."""
    counts = manifest["counts"]
    from pipeline.store.catalog import manifest_facts

    catalog = manifest_facts(manifest)  # the size and codec `ls` shows too
    store_bytes = catalog["bytes"]
    return {
        "schema_version": manifest["schema_version"],
        "dataset_id": manifest["dataset_id"],
        "num_samples": counts["samples"],
        "num_tokens": counts["tokens"],
        "num_loss_tokens": counts["loss_tokens"],
        "num_rejected": counts["rejected"],
        "rejected_by_reason": counts["rejected_by_reason"],
        "hidden_size": manifest["hidden_size"],
        "layers": manifest["layers"],
        "dtype": manifest["dtype"],
        "compression": catalog["compression"],
        "max_length": manifest.get("capture", {}).get("max_length"),
        "target": {k: v for k, v in manifest["target"].items() if k != "architecture"},
        "architecture": manifest["target"].get("architecture", {}),
        "store_bytes": store_bytes,
        "head_bytes": manifest["files"].get("head.safetensors", {}).get("bytes", 0),
        "shards": [{k: s[k] for k in ("name", "samples", "tokens", "bytes")} for s in manifest["shards"]],
    }


@click.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest facts as JSON.")
def info(store: str, as_json: bool) -> None:
    """Summarise the feature store STORE (a path or fsspec URL) without reading hidden states."""
    from pipeline.store.reader import open_store

    try:
        manifest = open_store(store, check_files=False).manifest
    except StoreError as error:
        raise click.ClickException(str(error)) from None
    facts = info_facts(manifest)
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    tokens = max(1, facts["num_tokens"])
    raw = facts["num_tokens"] * len(facts["layers"]) * facts["hidden_size"] * \
        {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 2, "int8": 2}[facts["dtype"]]  # lossy: ÷ bf16
    per_token = facts["store_bytes"] - facts["head_bytes"]
    rows = [
        ("store", store),
        ("dataset_id", facts["dataset_id"]),
        ("schema", facts["schema_version"]),
        ("target", facts["target"].get("name", "?")),
        ("hidden size", facts["hidden_size"]),
        ("layers", ", ".join(map(str, facts["layers"]))),
        ("dtype", facts["dtype"] + {"int8": " (lossy: int8 codes x a per-token scale, within half a step of "
                                             "each token's absmax / 127)",
                                    "float8_e4m3": " (lossy: e4m3 codes x a per-token scale)"}.get(facts["dtype"], "")),
        ("samples", f"{facts['num_samples']:,}"),
        ("tokens", f"{facts['num_tokens']:,} ({facts['num_loss_tokens']:,} in the loss)"),
        ("rejected", f"{facts['num_rejected']:,} " + (json.dumps(facts["rejected_by_reason"])
                                                      if facts["num_rejected"] else "")),
        ("shards", len(facts["shards"])),
        # The frozen head is a fixed cost per store; per-token figures leave it out, as extract's summary does.
        ("size", f"{_human_bytes(facts['store_bytes'])} ({per_token / tokens:,.0f} bytes/token + head "
                 f"{_human_bytes(facts['head_bytes'])}; {per_token / max(1, raw):.3f} x raw"
                 f"{' bf16' if facts['dtype'] in ('float8_e4m3', 'int8') else ''}"
                 f"{', ' + facts['compression'] if facts['compression'] != 'none' else ''})"),
    ]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


@click.command()
@click.argument("store")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def verify(store: str, no_progress: bool) -> None:
    """Recompute every checksum of STORE and check counts, lengths and finiteness.

    Exits 0 when the store is sound, 1 (naming each bad file) otherwise.
    """
    from tqdm import tqdm

    from pipeline.store.verify import verify_store

    with tqdm(unit="B", unit_scale=True, desc="verify", disable=no_progress or None, file=sys.stderr) as bar:
        report = verify_store(store, progress=bar.update)
    for relative, size in report.unlisted.items():
        click.echo(f"NOTE: {relative} ({_human_bytes(size)}) is not listed in the manifest: it is not part of the "
                   "store and is never read; delete it", err=True)
    if report.unknown_keys:
        click.echo(f"NOTE: manifest.json holds keys this format does not define: {', '.join(report.unknown_keys)}; "
                   "no reader uses them (a hand edit, or a newer writer)", err=True)
    if report.ok:
        click.echo(f"OK: {store} ({report.files_checked} files, {_human_bytes(report.bytes_checked)}) is sound")
        return
    for problem in report.problems:
        click.echo(f"BAD: {problem}", err=True)
    click.echo(f"{store}: {len(report.problems)} problem(s) found", err=True)
    sys.exit(1)


@click.command()
@click.argument("stores", nargs=-1, required=True)
@click.option("--out", required=True, help="Destination store (path or fsspec URL).")
@click.option("--overwrite", is_flag=True,
              help="DELETE a store (or unfinished store) of other inputs already at --out before merging (only "
                   "the files it lists: a folder holding anything else is refused); the merge of these same "
                   "stores is kept if complete, resumed if not.")
@click.option("--samples-per-shard", default=1024, show_default=True, help="Samples per output shard.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def merge(stores: tuple[str, ...], out: str, overwrite: bool, samples_per_shard: int, no_progress: bool) -> None:
    """Merge STORES (same target, tokenizer and capture settings) into one store at --out.

    Samples are deduplicated by sample id (the first store wins); counts and checksums are recomputed.
    Incompatible stores are refused with the differing field named.
    """
    from tqdm import tqdm

    from pipeline.store.merge import merge_stores
    from pipeline.store.reader import open_store

    try:
        total = sum(len(open_store(url, check_files=False)) for url in stores)
        with tqdm(total=total, unit="sample", desc="merge", disable=no_progress or None, file=sys.stderr) as bar:
            manifest = merge_stores(list(stores), out, overwrite=overwrite, samples_per_shard=samples_per_shard,
                                    progress=bar.update)
    except (StoreError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    except OSError as error:  # disk full or over quota: the shards written stay, no manifest is written
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise click.ClickException(
            f"writing {out} failed: {error.strerror or error}; the merge is unfinished (no manifest.json, readers "
            "refuse it); free space and rerun the same `beagle-pipeline merge` command to resume") from None
    dropped = manifest["extra"].get("merge", {}).get("duplicates_dropped", 0)
    click.echo(f"merged {len(stores)} stores into {out}: {manifest['counts']['samples']} samples, "
               f"{manifest['counts']['tokens']} tokens, {dropped} duplicate(s) dropped")


def _catalog_line(entry, width: int) -> str:
    """One `ls` line: state, URL, then for a complete store what a team picks it by."""
    if entry.state != "complete":
        return f"{entry.state:<11} {entry.url:<{width}}  {entry.problem}"
    weights = (entry.target_weights_sha256 or "?")[:12]
    codec = "" if entry.compression in (None, "none") else f"+{entry.compression}"
    return (f"{entry.state:<11} {entry.url:<{width}}  {entry.target} (weights {weights})  layers "
            f"{','.join(map(str, entry.layers))}  {entry.dtype}{codec}  {entry.samples:,} samples  "
            f"{entry.tokens:,} tokens  {_human_bytes(entry.bytes)}  {'+'.join(entry.checksums)}")


@click.command("ls")
@click.argument("url")
@click.option("--depth", default=2, show_default=True, type=click.IntRange(min=0),
              help="How many folder levels below URL to look for stores (0: URL itself).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON list (url, state, problem, dataset_id, target, target_weights_sha256, "
                   "layers, dtype, compression, samples, tokens, bytes, checksums) for scripts.")
@reports_errors
def list_stores_command(url: str, depth: int, as_json: bool) -> None:
    """List the feature stores under URL (a folder or an fsspec prefix such as s3://bucket/stores).

    One line per store: complete, unfinished or damaged, its target and weights fingerprint, layers, dtype,
    samples, tokens, size and checksum algorithm. Reads each store's manifest only, never its states.
    """
    from pipeline.store.catalog import list_stores

    entries = list_stores(url, depth=depth)
    if as_json:
        click.echo(json.dumps([entry.to_json() for entry in entries], indent=2))
        return
    if not entries:
        click.echo(f"no stores under {url} (looked {depth} level(s) down; --depth to look deeper)")
        return
    width = max(len(entry.url) for entry in entries)
    for entry in entries:
        click.echo(_catalog_line(entry, width))
