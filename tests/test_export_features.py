"""`export-features --format speculators`: one store, any trainer. What speculators' own reader yields from
the folder we write is the store: token ids, loss masks, aux states bit for bit, and a last state that the
target's final norm maps back to the stored one (speculators' teacher is `lm_head(norm(last))`)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from beagle.feature_export import aux_layers_of, check_norm_inverse, export_speculators, norm_gain
from beagle.torch_store import open_store
from beagle.target_model import read_final_norm
from pipeline.cli import main as cli
from tests.test_engine_export import _speculators_venv
from tests.tiny_store import build_tiny_store, tiny_target

ROOT = Path(__file__).resolve().parent.parent
READER = ROOT / "tests" / "speculators_read_features.py"
LAYERS = (1, 2, 3, -1)       # the three aux layers of a 4-layer target, and the state the LM head reads


@pytest.fixture(scope="module")
def target_and_store(tmp_path_factory):
    work = tmp_path_factory.mktemp("features")
    model = tiny_target(0, num_hidden_layers=4)
    store = build_tiny_store(work / "store", num_samples=10, dtype="bfloat16", model=model, layers=LAYERS,
                             model_dir=work / "target")
    return work / "target", store


def _export(store, target, out, *extra):
    return CliRunner().invoke(cli, ["export-features", str(store), "--model", str(target), "--out", str(out),
                                    "--no-progress", *extra])


def test_speculators_own_reader_yields_the_store(target_and_store, tmp_path):
    python = _speculators_venv()  # skipped here without it, a failure in CI
    target, store_url = target_and_store
    done = _export(store_url, target, tmp_path / "data")
    assert done.exit_code == 0, done.output
    assert "--target-layer-ids 1 2 3" in done.output
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([str(python), str(READER), str(tmp_path / "data"), "4096", str(tmp_path / "read.safetensors")],
                   check=True, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    read = load_file(str(tmp_path / "read.safetensors"))
    store = open_store(store_url)
    norm = read_final_norm(target)
    counts: dict[int, int] = {}
    for index in range(len(store)):
        sample = store[index]
        states = sample["hidden_states"]                                             # [4, L, d] bf16
        assert torch.equal(read[f"{index}.input_ids"], sample["input_ids"].long())
        assert torch.equal(read[f"{index}.loss_mask"].bool(), sample["loss_mask"])
        aux = states[:3].transpose(0, 1).reshape(states.shape[1], -1)                # [L, 3d], layer order
        assert read[f"{index}.hidden_states"].dtype == torch.bfloat16
        assert torch.equal(read[f"{index}.hidden_states"], aux)
        with torch.no_grad():
            renormed = norm(read[f"{index}.verifier_last_hidden_states"].float())
        torch.testing.assert_close(renormed, states[3].float(), rtol=2e-2, atol=2e-2)
        for token in sample["input_ids"][sample["loss_mask"]].tolist():
            counts[token] = counts.get(token, 0) + 1
    assert read["approx_lengths"].tolist() == [int(n) for n in store.lengths]
    assert {int(t): int(c) for t, c in read["token_freq"].tolist()} == counts
    written = json.loads((tmp_path / "data" / "beagle_features.json").read_text())
    assert written["dataset_id"] == store.dataset_id and written["target_layer_ids"] == [1, 2, 3]


def test_an_interrupted_export_leaves_no_output_and_resumes(target_and_store, tmp_path):
    target, store_url = target_and_store
    norm, out = read_final_norm(target), tmp_path / "data"
    written = []

    def crash_after_three(n):
        written.append(n)
        if len(written) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_speculators(store_url, out, final_norm=norm, progress=crash_after_three)
    assert not out.exists()                                       # nothing mistaken for a whole export
    staging = tmp_path / ".data.incomplete"
    assert len(list((staging / "hidden_states").glob("hs_*.safetensors"))) == 3
    result = export_speculators(store_url, out, final_norm=norm)
    assert result.resumed == 3 and result.samples == 10 and not staging.exists()
    again = export_speculators(store_url, tmp_path / "fresh", final_norm=norm)
    for index in range(10):
        name = f"hidden_states/hs_{index}.safetensors"
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    assert again.tokens == result.tokens


def test_only_our_own_export_is_replaced(target_and_store, tmp_path):
    target, store_url = target_and_store
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    done = _export(store_url, target, foreign, "--force")
    assert done.exit_code == 1 and "is not an export-features output" in done.output
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert _export(store_url, target, tmp_path / "ours").exit_code == 0
    done = _export(store_url, target, tmp_path / "ours")
    assert done.exit_code == 1 and "pass --force" in done.output
    assert _export(store_url, target, tmp_path / "ours", "--force").exit_code == 0


def test_another_target_s_folder_is_refused(target_and_store, tmp_path):
    _, store_url = target_and_store
    tiny_target(1, num_hidden_layers=4).save_pretrained(tmp_path / "other")
    done = _export(store_url, tmp_path / "other", tmp_path / "data")
    assert done.exit_code == 1 and "not the ones" in done.output and not (tmp_path / "data").exists()


def test_stores_without_aux_layers_or_without_the_last_state_are_refused():
    with pytest.raises(ValueError, match="default --layers"):
        aux_layers_of([-1])
    with pytest.raises(ValueError, match="without -1"):
        aux_layers_of([1, 2, 3])
    assert aux_layers_of([2, 15, 27, -1]) == ([2, 15, 27], 3)


def test_a_norm_that_is_not_a_gain_of_x_over_its_rms_is_refused():
    torch.manual_seed(0)
    states = torch.randn(7, 16)
    layer_norm = torch.nn.LayerNorm(16)
    torch.nn.init.normal_(layer_norm.bias)
    after = layer_norm(states).detach()
    with pytest.raises(ValueError, match="not a per-channel gain"):
        check_norm_inverse(layer_norm, after, norm_gain(layer_norm, 16), torch.float32)
    rms_norm = torch.nn.RMSNorm(16, eps=1e-6)
    torch.nn.init.uniform_(rms_norm.weight, 0.5, 1.5)
    after = rms_norm(states).detach()
    assert check_norm_inverse(rms_norm, after, norm_gain(rms_norm, 16), torch.float32) < 1e-5
