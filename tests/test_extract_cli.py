"""The `extract` command's fast paths: one-line failures and --dry-run (no Ray, no model forward)."""
import json

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.tiny import build_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target"), template="chatml_generation")


@pytest.fixture()
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([
        json.dumps({"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi there!"}]}),
        json.dumps({"messages": [{"role": "user", "content": "Capital of France?"},
                                 {"role": "assistant", "content": "Paris."}]}),
        "{broken",
    ]) + "\n")
    return path


def _run(*args):
    return CliRunner().invoke(main, ["extract", *args], catch_exceptions=False)


def test_dry_run_prints_tokens_and_estimated_size_without_writing(target, chats, tmp_path):
    out = tmp_path / "store"
    result = _run("--model", str(target), "--data", str(chats), "--out", str(out), "--dry-run", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "samples      2" in result.output and "malformed_json" in result.output
    assert "tokens" in result.output and "est. size" in result.output and "bytes/token" in result.output
    assert not out.exists()


@pytest.mark.parametrize("case", ["data", "weights", "tokenizer", "layers"])
def test_bad_setups_fail_at_once_with_one_line_naming_them(target, chats, tmp_path, case):
    model, data, extra = str(target), str(chats), []
    if case == "data":
        data = str(tmp_path / "missing.jsonl")
    elif case == "weights":
        model = str(tmp_path / "empty_model")
        (tmp_path / "empty_model").mkdir()
        (tmp_path / "empty_model" / "config.json").write_text((target / "config.json").read_text())
    elif case == "tokenizer":
        model = str(tmp_path / "no_tokenizer")
        (tmp_path / "no_tokenizer").mkdir()
        for name in ("config.json", "model.safetensors"):
            (tmp_path / "no_tokenizer" / name).write_bytes((target / name).read_bytes())
    else:
        extra = ["--layers", "7"]
    result = _run("--model", model, "--data", data, "--out", str(tmp_path / "store"), "--dry-run", *extra)
    assert result.exit_code == 1
    message = result.output.strip()
    assert message.count("\n") == 0 and message.startswith("Error: ")
    expected = {"data": "missing.jsonl: no such file", "weights": "no weight files",
                "tokenizer": "cannot load its tokenizer", "layers": "--layers 7: out of range"}[case]
    assert expected in message and (case == "layers" or (model if case != "data" else data) in message)


def test_the_ray_job_entry_point_runs_the_same_command(target, chats, tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "jobs" / "extract.py"
    result = subprocess.run([sys.executable, str(script), "--model", str(target), "--data", str(chats),
                             "--out", str(tmp_path / "store"), "--dry-run", "--no-progress"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "samples      2" in result.stdout and "est. size" in result.stdout


def test_a_bf16_target_on_a_cpu_that_emulates_bf16_is_warned_about_once(target, chats, tmp_path, caplog,
                                                                        monkeypatch):
    """The default --dtype bfloat16 on an AVX2-only CPU forwards several times slower than float32: one
    warning names the fix. Checked against this machine's own answer, so it holds (and can fail) on any CPU."""
    import logging

    import torch

    from beagle.precision import bf16_is_emulated

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    emulated = bf16_is_emulated(on_gpu=torch.cuda.is_available())
    for extra, expected in (([], 1 if emulated else 0), (["--dtype", "float32"], 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pipeline.extract.pipeline"):
            result = _run("--model", str(target), "--data", str(chats), "--out", str(tmp_path / "store"),
                          "--dry-run", "--no-progress", *extra)
        assert result.exit_code == 0, result.output
        warned = [r.getMessage() for r in caplog.records if "is emulated" in r.getMessage()]
        assert len(warned) == expected, (extra, warned)
        assert all("--dtype float32" in message for message in warned)
