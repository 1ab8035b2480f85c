"""A drafter form is one row and one module: the proof.

tests/throwaway_form.py is a form nobody else names (its class and its row). Added to beagle/registry.py's
FORMS for this test alone, it trains, validates, decodes and exports through the normal commands, and the
options and formats its row does not declare are refused in one line, with no other file of the project
knowing it exists.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from beagle import registry
from pipeline.cli import main
from tests.decoding_helpers import chat_tokenizer_dir, tiny_target, write_jsonl
from tests.throwaway_form import ROW, ThrowawayDrafter
from tests.tiny_store import build_tiny_store

TRAIN = ["--stage1-epochs", "1", "--stage2-epochs", "1", "--window-size", "3", "--simulation-steps", "2",
         "--lr", "1e-3", "--warmup-steps", "0", "--batch-tokens", "256", "--device", "cpu", "--no-progress"]


@pytest.fixture
def with_throwaway_form(monkeypatch):
    monkeypatch.setitem(registry.FORMS, ROW.name, ROW)  # the one row a new form adds
    return ROW


def _one_line_error(result, status: int, *fragments: str) -> None:
    assert result.exit_code == status, result.output
    assert all(fragment in result.output for fragment in fragments), result.output
    if status == 1:
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_new_form_trains_decodes_and_exports_through_the_commands(with_throwaway_form, tmp_path):
    tokenizer = chat_tokenizer_dir(tmp_path / "target", words=40)
    target = tiny_target(vocab_size=len(tokenizer), context_scale=0.15, seed=2)
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    store = build_tiny_store(tmp_path / "store", num_samples=10, model=target, model_dir=tmp_path / "target")
    runner, run = CliRunner(), tmp_path / "run"

    assert "throwaway" in registry.train_drafters()
    result = runner.invoke(main, ["train", "--store", store, "--out", str(run), "--drafter", "throwaway",
                                  "--val-samples", "2", "--eval-every", "1000", *TRAIN])
    assert result.exit_code == 0, result.output
    meta = json.loads((run / "drafter" / "config.json").read_text())
    assert meta["drafter_type"] == "throwaway"
    trained = load_file(run / "drafter" / "model.safetensors")
    assert "head_gain" in trained and not bool((trained["head_gain"] == 1).all())  # its own weight, trained
    validation = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                  if "val" in line]
    assert validation, "held-out validation scored the new form by the offline chain of its row"

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "w1 w2 w3"}, {"prompt": "w7 w8"}])
    common = ["eval", "--model", str(tmp_path / "target"), "--drafter", str(run / "drafter"), "--prompts",
              str(prompts), "--max-new-tokens", "12", "--no-progress"]
    result = runner.invoke(main, [*common, "--chain", "--depth", "3", "--json", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    assert "outputs match plain greedy decoding" in result.output
    assert json.loads((tmp_path / "eval.json").read_text())["outputs_match"] is True

    result = runner.invoke(main, ["export", str(run), "--format", "native", "--out", str(tmp_path / "native")])
    assert result.exit_code == 0, result.output
    assert "exported throwaway drafter" in result.output
    assert (tmp_path / "native" / "model.safetensors").read_bytes() == (run / "drafter" / "model.safetensors").read_bytes()

    # What its row does not declare is refused in one line, before any work.
    _one_line_error(runner.invoke(main, ["export", str(run), "--format", "eagle3", "--target",
                                         str(tmp_path / "target"), "--out", str(tmp_path / "e3")]),
                    1, "--format eagle3: drafter form throwaway has no eagle3 form (it exports to native)")
    assert not (tmp_path / "e3").exists()
    _one_line_error(runner.invoke(main, [*common, "--chain", "--depth", "3", "--no-concat"]),  # not in its row
                    1, "--no-concat: drafter form throwaway always feeds drafted states back")
    _one_line_error(runner.invoke(main, ["train", "--store", store, "--out", str(tmp_path / "r2"), "--drafter",
                                         "throwaway", "--key-layers", "1", *TRAIN]),
                    2, "--key-layers (key_layers) does not apply to drafter form throwaway")
    assert registry.capture_layers(["throwaway"], 4) == [-1]


def test_the_row_builds_the_form_and_the_project_never_names_it(with_throwaway_form):
    """A saved drafter of the new form loads as its class, by its drafter_type alone, and no file of the
    project's own code names the form."""
    import subprocess
    from pathlib import Path

    from beagle.drafter_folder import load_drafter, save_drafter
    from beagle.model import DrafterConfig

    target = tiny_target(vocab_size=64, seed=1)
    head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    built = registry.form_named("throwaway").build(DrafterConfig.from_architecture(target.config.to_dict()), *head)
    folder = Path(__import__("tempfile").mkdtemp()) / "drafter"
    save_drafter(folder, built, metadata={})
    loaded, meta = load_drafter(folder, embed_tokens=head[0], lm_head=head[1])
    assert type(loaded) is ThrowawayDrafter and meta["drafter_type"] == "throwaway"
    repo = Path(__file__).resolve().parent.parent
    found = subprocess.run(["git", "grep", "-l", "throwaway", "--", "beagle", "pipeline", "jobs"], cwd=repo,
                           capture_output=True, text=True)
    assert found.stdout == "", found.stdout


def test_no_form_is_decided_outside_the_registry_and_the_forms_modules():
    """No isinstance against a drafter class, no duck-typed drafter attribute, no comparison with a form's
    name in the library outside beagle/registry.py and the forms' own modules."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    own = {"registry.py", "model.py", "state_beagle.py", "eagle2.py"}
    names = "|".join(re.escape(name) for name in registry.FORMS)
    patterns = [re.compile(r"isinstance\([^)]*(Drafter|Beagle|Eagle2)\b"),
                re.compile(r"(hasattr|getattr)\([^)]*\"(compact_logits|layer_fusion|key_layers|drafter|carries_state)\""),
                re.compile(rf"(==|!=)\s*\"({names})\"|\"({names})\"\s*(==|!=)"),
                re.compile(r"residual\s*(==|!=)\s*\"")]
    offenders = []
    for path in [*repo.glob("beagle/**/*.py"), *repo.glob("pipeline/**/*.py"), *repo.glob("bench/*.py")]:
        if path.name in own and path.parent.name == "beagle":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if any(p.search(line) for p in patterns):
                offenders.append(f"{path.relative_to(repo)}:{number}: {line.strip()}")
    assert offenders == []
