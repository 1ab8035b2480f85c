"""Runs that must match what they continue or evaluate: `eval` refuses a target whose weights are not the
drafter's, `train --resume` refuses stores other than the run's. Real files, real commands."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from beagle.drafter_folder import save_drafter
from pipeline.cli import main as cli_main
from tests.decoding_helpers import bigram_drafter, chat_tokenizer_dir, tiny_target, write_jsonl

WORDS = 40


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """(target, the same shape with other weights, a drafter trained for the first, prompts)."""
    from pipeline.jobkit.target import target_fingerprint

    root = tmp_path_factory.mktemp("targets")
    tokenizer = chat_tokenizer_dir(root / "target", words=WORDS)
    models = {}
    for name, seed in (("target", 2), ("fine-tune", 3)):
        models[name] = tiny_target(vocab_size=len(tokenizer), context_scale=0.15, seed=seed)
        models[name].generation_config.eos_token_id = tokenizer.eos_token_id
        if name != "target":
            shutil.copytree(root / "target", root / name)
        models[name].save_pretrained(root / name)
    trained_on = target_fingerprint(str(root / "target"), "float32")  # what extract records, train copies
    save_drafter(root / "drafter", bigram_drafter(models["target"]), metadata={"target": {
        key: trained_on[key] for key in ("name", "config_sha256", "weights_sha256")}})
    prompts = write_jsonl(root / "question.jsonl", [{"prompt": "w20 w21"}])
    return root / "target", root / "fine-tune", root / "drafter", prompts


def _eval(target: Path, drafter: Path, prompts: Path, *extra: str):
    return CliRunner().invoke(cli_main, ["eval", "--model", str(target), "--drafter", str(drafter), "--prompts",
                                         str(prompts), "--max-new-tokens", "4", "--chain", "--depth", "2",
                                         "--no-progress", *extra])


def test_eval_refuses_a_target_with_other_weights_unless_told(targets):
    """Same config, same shape, other weights (a fine-tune): the drafter records the weights' sha256, so
    eval refuses with one line naming both; --allow-other-target-weights evaluates anyway."""
    target, fine_tune, drafter, prompts = targets
    assert (target / "config.json").read_bytes() == (fine_tune / "config.json").read_bytes()
    result = _eval(fine_tune, drafter, prompts)
    assert result.exit_code == 1, result.output
    assert "was trained on a target whose weights have sha256" in result.output
    assert "--allow-other-target-weights" in result.output and "Traceback" not in result.output
    result = _eval(fine_tune, drafter, prompts, "--allow-other-target-weights")
    assert result.exit_code == 0, result.output
    result = _eval(target, drafter, prompts)
    assert result.exit_code == 0 and "outputs match plain greedy decoding" in result.output, result.output


def test_resume_refuses_other_stores_of_the_same_target(tmp_path):
    """A run trained 2 steps on store A; --resume on store B (same target, other samples) is refused with
    one line naming both, and nothing of the run changes; A moved elsewhere resumes."""
    from tests.test_reliability_store import TRAIN_FLAGS, _build

    first, other = _build(tmp_path / "a", seed=0), _build(tmp_path / "b", seed=7)
    run = tmp_path / "run"
    flags = list(TRAIN_FLAGS)
    result = CliRunner().invoke(cli_main, ["train", "--store", first, "--out", str(run), *flags])
    assert result.exit_code == 0, result.output
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    more = [*flags[:flags.index("--max-steps")], "--max-steps", "3", *flags[flags.index("--max-steps") + 2:]]
    for stores in ([other], [first, other]):
        command = ["train", "--out", str(run), "--resume", *more]
        for store in stores:
            command += ["--store", store]
        result = CliRunner().invoke(cli_main, command)
        assert result.exit_code == 1, result.output  # a state error, not a usage one
        assert "--resume with stores" in result.output and "the run in" in result.output, result.output
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    moved = shutil.move(first, tmp_path / "moved")
    result = CliRunner().invoke(cli_main, ["train", "--store", str(moved), "--out", str(run), "--resume", *more])
    assert result.exit_code == 0 and "trained 3 steps" in result.output, result.output
