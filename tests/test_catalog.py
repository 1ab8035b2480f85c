"""`beagle-pipeline ls`: the stores under a folder or an S3 prefix (moto's server on 127.0.0.1), from their
manifests alone; unfinished, damaged and foreign folders are listed as such, never raised."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.store.catalog import list_stores
from tests.test_store import build, make_samples

pytest.importorskip("moto.server", reason="moto[server] and s3fs (dev extras) test the S3 path")
pytest.importorskip("s3fs")


def _team_folder(root: Path) -> dict[str, Path]:
    """Two complete stores (one nested a level down), one being built, one damaged, one unrelated folder."""
    stores = {"bf16": root / "bf16", "int8": root / "team-a" / "int8-zstd"}
    build(str(stores["bf16"]), make_samples(6, torch.bfloat16), "bfloat16")
    build(str(stores["int8"]), make_samples(5, torch.float32, layers=2), "int8", layers=[3, -1], compression="zstd")
    (root / "building" / "shards").mkdir(parents=True)
    (root / "building" / "_pending.json").write_text('{"dataset_id": "x", "command": "extract"}')
    shutil.copytree(stores["bf16"], root / "broken")
    (root / "broken" / "manifest.json").write_text('{"schema_version": "1.0"')
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a store")
    return stores


def test_a_folder_of_stores_is_listed_one_line_each(tmp_path):
    _team_folder(tmp_path)
    result = CliRunner().invoke(main, ["ls", str(tmp_path)])
    assert result.exit_code == 0, result.output
    parsed = [re.match(r"^(complete|unfinished|damaged|not a store)\s+(\S+)", line)
              for line in result.output.strip().splitlines()]
    lines = {match.group(2): match.string for match in parsed}
    assert set(lines) == {str(tmp_path / name) for name in ("bf16", "team-a/int8-zstd", "building", "broken", "notes")}
    bf16 = lines[str(tmp_path / "bf16")]
    assert bf16.startswith("complete") and "tiny" in bf16 and "bfloat16" in bf16 and "6 samples" in bf16
    assert "blake3" in bf16 and "layers -1" in bf16
    int8 = lines[str(tmp_path / "team-a/int8-zstd")]
    assert "int8+zstd" in int8 and "layers 3,-1" in int8 and "5 samples" in int8
    assert lines[str(tmp_path / "building")].startswith("unfinished")
    assert lines[str(tmp_path / "broken")].startswith("damaged") and "not valid JSON" in lines[str(tmp_path / "broken")]
    assert lines[str(tmp_path / "notes")].startswith("not a store")


def test_json_is_for_scripts_and_agrees_with_info(tmp_path):
    stores = _team_folder(tmp_path)
    result = CliRunner().invoke(main, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    entries = {entry["url"]: entry for entry in json.loads(result.output)}
    entry = entries[str(stores["bf16"])]
    info = json.loads(CliRunner().invoke(main, ["info", str(stores["bf16"]), "--json"]).output)
    assert entry["state"] == "complete" and entry["dataset_id"] == info["dataset_id"]
    assert (entry["samples"], entry["tokens"], entry["bytes"]) == (info["num_samples"], info["num_tokens"],
                                                                  info["store_bytes"])
    assert entry["checksums"] == ["blake3"] and entry["compression"] == "none"
    assert entries[str(tmp_path / "building")]["state"] == "unfinished"


def test_ls_reads_manifests_only(tmp_path):
    """With every state and sample file of a store gone, ls still lists it as its manifest describes: it
    never opens them (verify is what checks them)."""
    stores = _team_folder(tmp_path)
    for shard in (stores["bf16"] / "shards").iterdir():
        shutil.rmtree(shard / "hidden_states")
        (shard / "samples.arrow").unlink()
    (entry,) = [e for e in list_stores(str(tmp_path)) if e.url == str(stores["bf16"])]
    assert entry.state == "complete" and entry.samples == 6


def test_depth_and_a_missing_url(tmp_path):
    _team_folder(tmp_path)
    assert {e.url for e in list_stores(str(tmp_path), depth=1)} == \
        {str(tmp_path / n) for n in ("bf16", "building", "broken", "notes")} | {str(tmp_path / "team-a")}
    assert [e.state for e in list_stores(str(tmp_path / "bf16"), depth=0)] == ["complete"]
    missing = CliRunner().invoke(main, ["ls", str(tmp_path / "nowhere")])
    assert missing.exit_code == 1 and "does not exist" in missing.output and len(missing.output.splitlines()) == 1


def test_an_s3_prefix_is_listed_like_a_folder(tmp_path):
    import s3fs

    from tests.local_s3 import local_s3_bucket

    with local_s3_bucket("catalog-test") as bucket:
        local = tmp_path / "local"
        _team_folder(local)
        s3fs.S3FileSystem(skip_instance_cache=True).put(str(local), f"{bucket[5:]}/stores", recursive=True)
        entries = {e.url: e for e in list_stores(f"{bucket}/stores")}
        assert entries[f"{bucket}/stores/bf16"].state == "complete"
        assert entries[f"{bucket}/stores/team-a/int8-zstd"].dtype == "int8"
        assert entries[f"{bucket}/stores/building"].state == "unfinished"
        assert entries[f"{bucket}/stores/broken"].state == "damaged"
        result = CliRunner().invoke(main, ["ls", f"{bucket}/stores", "--json"])
        assert result.exit_code == 0, result.output
        assert len(json.loads(result.output)) == len(entries)


def test_a_symlink_loop_lists_each_store_once(tmp_path):
    root = tmp_path / "stores"
    build(str(root / "team" / "a"), make_samples(2, torch.bfloat16), "bfloat16")
    (root / "team" / "loop").symlink_to(root, target_is_directory=True)   # team/loop/team/a is team/a again
    (root / "again").symlink_to(root / "team", target_is_directory=True)
    urls = [e.url for e in list_stores(str(root), depth=4)]
    assert urls == [str(root / "team" / "a")], urls
