"""`export-features --format specforge`: what SpecForge's offline EAGLE-3 reader takes from the folder we write
is the store: token ids, loss masks, the three aux layers bit for bit, and a last state whose LM-head logits
are the target's (SpecForge's teacher is `TargetHead`, the LM head alone).

SpecForge itself is not installed here (it depends on sglang, which needs a GPU build), so
`_read_like_specforge` does what its reader does, as read at commit a6b6b02 (beagle/specforge_features.py):
list every `*.ckpt` / `*.ckpt.gz` under the folder with `os.walk`, sorted; `torch.load(path,
weights_only=False, mmap=True)`; take `aux_hidden_state.squeeze(0)[:max_len]` as the draft's input and
`hidden_state.squeeze(0)[:max_len]` as the teacher's. Where `specforge` is importable (PyPI's 0.2.0 holds the
same reader, and `pip install --no-deps specforge==0.2.0` is enough to import it beside our venv),
`test_specforge_s_own_reader_yields_the_store` runs its own classes too; it passed so by hand (2026-12-04)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from beagle.specforge_features import export_specforge, sample_path, specforge_layer_ids
from beagle.torch_store import open_store
from pipeline.cli import main as cli
from tests.tiny_store import build_tiny_store, tiny_target

LAYERS = (1, 2, 3, -1)       # the three aux layers of a 4-layer target, and the state the LM head reads
KEYS = ["input_ids", "loss_mask", "aux_hidden_state", "hidden_state"]  # its generator's order


@pytest.fixture(scope="module")
def target_and_store(tmp_path_factory):
    work = tmp_path_factory.mktemp("specforge")
    model = tiny_target(0, num_hidden_layers=4)
    store = build_tiny_store(work / "store", num_samples=10, dtype="bfloat16", model=model, layers=LAYERS,
                             model_dir=work / "target")
    return work / "target", store, model


def _export(store, target, out, *extra):
    return CliRunner().invoke(cli, ["export-features", str(store), "--format", "specforge", "--model",
                                    str(target), "--out", str(out), "--no-progress", *extra])


def _read_like_specforge(folder: Path) -> list[tuple[str, dict]]:
    """(path, raw record) for every feature file, as SpecForge's OfflineManifestReader and load_feature_file."""
    paths = sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                   if name.endswith((".ckpt", ".ckpt.gz")))
    return [(path, torch.load(path, weights_only=False, mmap=True)) for path in paths]


def _index(path: str) -> int:
    return int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))


def test_specforge_s_reader_yields_the_store(target_and_store, tmp_path):
    target, store_url, model = target_and_store
    done = _export(store_url, target, tmp_path / "data")
    assert done.exit_code == 0, done.output
    config_path = tmp_path / "data" / "specforge_eagle3.json"
    assert f"train with: specforge train --config {config_path}" in done.output
    store = open_store(store_url)
    read = _read_like_specforge(tmp_path / "data")
    assert sorted(_index(path) for path, _ in read) == list(range(len(store)))
    d = store.hidden_size
    for path, raw in read:
        index = _index(path)
        assert path.endswith(sample_path(index)) and "rows_0-2000" in path
        assert list(raw) == KEYS
        sample = store[index]
        states, length = sample["hidden_states"], len(sample["input_ids"])              # [4, L, d] bf16
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert torch.equal(raw["input_ids"], sample["input_ids"].long())                 # [L]
        assert torch.equal(raw["loss_mask"], sample["loss_mask"].long())                 # [L]
        assert raw["aux_hidden_state"].shape == (1, length, 3 * d)
        assert raw["hidden_state"].shape == (1, length, d)
        assert raw["aux_hidden_state"].dtype == raw["hidden_state"].dtype == torch.bfloat16
        aux = raw["aux_hidden_state"].squeeze(0)                                         # [L, 3d], layer order
        for k in range(3):
            assert torch.equal(aux[:, k * d:(k + 1) * d], states[k])
        assert torch.equal(raw["hidden_state"].squeeze(0), states[3])
        for tensor in raw.values():  # no file carries more than its sample (a slice would carry its shard)
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    with torch.no_grad():  # the teacher SpecForge builds, lm_head(hidden_state), is the target's own
        ids = read[0][1]["input_ids"]
        logits = model(input_ids=ids[None]).logits[0]
        teacher = model.lm_head(read[0][1]["hidden_state"][0].float())
    torch.testing.assert_close(teacher, logits, rtol=5e-2, atol=5e-2)
    config = json.loads(config_path.read_text())
    assert config == {"model": {"target_model_path": str(target.resolve()), "aux_hidden_state_layer_ids": [0, 1, 2]},
                      "data": {"hidden_states_path": str((tmp_path / "data").resolve()),
                               "max_length": max(int(n) for n in store.lengths)},
                      "training": {"strategy": "eagle3"}}
    written = json.loads((tmp_path / "data" / "beagle_features.json").read_text())
    assert written["format"] == "specforge" and written["dataset_id"] == store.dataset_id
    assert torch.load(read[0][0], weights_only=True).keys() == read[0][1].keys()  # plain tensors, no pickled code


# `make test` installs PyPI's specforge 0.2.0 here without its dependencies (sglang needs a GPU build); its reader
# imports only what .venv already has.
SPECFORGE_READER = Path(__file__).resolve().parent.parent / ".venv" / "specforge-reader"


def test_specforge_s_own_reader_yields_the_store(target_and_store, tmp_path, monkeypatch):
    if SPECFORGE_READER.is_dir():
        monkeypatch.syspath_prepend(str(SPECFORGE_READER))
    offline_reader = pytest.importorskip("specforge.runtime.data_plane.offline_reader",
                                         reason="specforge's reader is not installed: run `make test`")
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.runtime.data_plane.feature_store import load_feature_file

    target, store_url, _ = target_and_store
    export_specforge(store_url, tmp_path / "data", target=target)
    store = open_store(store_url)
    refs = offline_reader.OfflineManifestReader(str(tmp_path / "data"), validate_files=True).read()
    legacy = build_offline_eagle3_dataset(str(tmp_path / "data"), max_len=4096)
    assert len(refs) == len(legacy) == len(store)
    for position, ref in enumerate(refs):
        path = ref.feature_store_uri.removeprefix("file://")
        ready = normalize_offline_sample(load_feature_file(path), max_len=4096)
        sample, old = store[_index(path)], legacy[position]
        states = sample["hidden_states"]
        assert torch.equal(ready["input_ids"][0], sample["input_ids"].long())
        mask = sample["loss_mask"].long().clone()
        mask[-1] = 0  # SpecForge never trains on the last position
        assert torch.equal(ready["loss_mask"][0], mask) and torch.equal(old["loss_mask"][0], mask)
        assert torch.equal(ready["hidden_state"][0], torch.cat(list(states[:3]), dim=-1))
        assert torch.equal(ready["target"][0], states[3]) and torch.equal(old["target"][0], states[3])


def test_an_interrupted_export_leaves_no_output_and_resumes(target_and_store, tmp_path):
    target, store_url, _ = target_and_store
    out, written = tmp_path / "data", []

    def crash_after_three(n):
        written.append(n)
        if len(written) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_specforge(store_url, out, target=target, progress=crash_after_three)
    assert not out.exists()                                       # nothing mistaken for a whole export
    staging = tmp_path / ".data.incomplete"
    assert len(list(staging.glob("rows_*/data_*.ckpt"))) == 3
    (staging / "rows_0-2000" / ".data_5.ckpt.tmp-999").write_bytes(b"half a file")  # a killed save
    result = export_specforge(store_url, out, target=target)
    assert result.resumed == 3 and result.samples == 10 and not staging.exists()
    assert not list(out.rglob("*.tmp-*"))
    export_specforge(store_url, tmp_path / "fresh", target=target)
    for index in range(10):
        assert (out / sample_path(index)).read_bytes() == (tmp_path / "fresh" / sample_path(index)).read_bytes()


def test_a_sample_holding_nan_is_left_out_as_specforge_leaves_it(tmp_path):
    store = build_tiny_store(tmp_path / "store", num_samples=4, dtype="bfloat16", layers=LAYERS,
                             num_hidden_layers=4, model_dir=tmp_path / "target", nan_sample=2)
    done = _export(store, tmp_path / "target", tmp_path / "data", "--no-verify")  # verify refuses NaN
    assert done.exit_code == 0, done.output
    assert "wrote 3 samples" in done.output and "1 holding NaN left out" in done.output
    assert sorted(_index(path) for path, _ in _read_like_specforge(tmp_path / "data")) == [0, 1, 3]


def test_stores_without_specforge_s_three_aux_layers_are_refused(tmp_path):
    assert specforge_layer_ids([2, 16, 29, -1], 32) == ([1, 15, 28], 3)  # SpecForge's own default for 32
    assert specforge_layer_ids([-1, 29, 2, 16], 32) == ([1, 15, 28], 0)  # concatenated in layer order
    for layers in ([2, -1], [2, 10, 16, 29, -1], [0, 16, 29, -1]):
        with pytest.raises(ValueError, match=r"exactly three.*`extract --layers 2 16 29 -1`"):
            specforge_layer_ids(layers, 32)
    store = build_tiny_store(tmp_path / "store", num_samples=2, layers=(2, -1), num_hidden_layers=4,
                             model_dir=tmp_path / "target")
    done = _export(store, tmp_path / "target", tmp_path / "data")
    assert done.exit_code == 1 and "extract --layers 1 2 3 -1" in done.output
    assert len(done.output.strip().splitlines()) == 1 and not (tmp_path / "data").exists()
