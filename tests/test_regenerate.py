"""`regenerate` on a real local Ray with a tiny real target: answers, rejects, resume, and extract reading it."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from beagle.prompts import render
from pipeline.cli import main
from pipeline.jobkit.target import load_tokenizer
from pipeline.extract.pipeline import ExtractConfig, dry_run
from pipeline.regenerate.generation import GenerateConfig
from pipeline.regenerate.job import (RegenerateConfig, manifest_path, partial_dir, rejects_path, run_regenerate)
from tests.local_ray import local_ray
from tests.tiny import build_target

pytestmark = pytest.mark.slow

RECORDS = [
    {"id": "chat", "conversations": [{"from": "human", "value": "What is the capital of France?"},
                                     {"from": "gpt", "value": "A stored answer that must not survive."},
                                     {"from": "human", "value": "Write a short poem about the sea."},
                                     {"from": "gpt", "value": "Another stored answer."}]},
    {"id": "one", "prompt": "Hello, how are you today?"},
    {"question_id": 81, "turns": ["The quick brown fox.", "Numbers 0123456789 please."]},
    {"id": "sys", "messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Sure! Here is a list: 1, 2, 3."}]},
]
BAD_LINES = ['{"prompt": ', '"a string"', '{"title": "x"}', '{"messages": [{"role": "tool", "content": "x"}]}',
             '{"prompt": "   "}', '{"id": "one", "prompt": "duplicate id"}',
             json.dumps({"id": "long", "prompt": "long " * 200})]
BAD_REASONS = ["malformed_json", "not_an_object", "missing_field", "unknown_role", "no_user_turn", "duplicate_id",
               "prompt_too_long"]


@pytest.fixture(scope="module")
def ray_address():
    with local_ray(num_cpus=2) as address:
        yield address


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("regenerate")
    target = build_target(root / "target", template="chatml")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "\n".join(BAD_LINES) + "\n")
    return {"root": root, "target": target, "data": data}


def _config(workspace, out, **changes) -> RegenerateConfig:
    generate = GenerateConfig(model_path=str(workspace["target"]), dtype="float32", max_new_tokens=8,
                              max_prompt_length=120, batch_size=3)
    return RegenerateConfig(generate=generate, data=(str(workspace["data"]),), out=str(out), chunk_size=2,
                            num_workers=1, **changes)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def regenerated(workspace, ray_address):
    out = workspace["root"] / "answers.jsonl"
    summary = run_regenerate(_config(workspace, out))
    return out, summary


def test_answers_are_the_targets_own_greedy_answers_turn_by_turn(workspace, regenerated):
    """Each answer equals unpadded greedy generation on the conversation so far (the earlier answers included)."""
    out, summary = regenerated
    conversations = _lines(out)
    assert [c["id"] for c in conversations] == ["chat", "one", "81", "sys"]  # input order, rejects left out
    tokenizer = load_tokenizer(str(workspace["target"]))
    model = AutoModelForCausalLM.from_pretrained(str(workspace["target"]), dtype=torch.float32).eval()
    answers = 0
    for conversation in conversations:
        messages = conversation["messages"]
        assert "stored answer" not in json.dumps(messages)
        assert [m["role"] for m in messages if m["role"] != "system"] == ["user", "assistant"] * (
            sum(m["role"] == "user" for m in messages))
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = torch.tensor([render(tokenizer, messages[:k])])
            with torch.inference_mode():
                row = model.generate(prompt, max_new_tokens=8, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)[0, prompt.shape[1]:].tolist()
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id)]
            assert message["content"] == tokenizer.decode(row, skip_special_tokens=True), (conversation["id"], k)
            answers += 1
    assert conversations[3]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert answers == summary.turns == 6
    assert summary.conversations == 4
    assert 0 < summary.generated_tokens <= 6 * 8


def test_bad_records_are_counted_and_written_with_file_and_reason(workspace, regenerated):
    out, summary = regenerated
    rejects = _lines(rejects_path(str(out)))
    assert [r["reason"] for r in rejects] == BAD_REASONS
    assert all(r["source"] == str(workspace["data"]) and r["line"] == len(RECORDS) + 1 + i
               for i, r in enumerate(rejects))
    assert summary.rejected == len(BAD_LINES)
    manifest = json.loads(manifest_path(str(out)).read_text())
    assert manifest["counts"]["conversations"] == 4
    assert manifest["target"]["weights_sha256"] and manifest["sources"][0]["sha256"]
    assert not partial_dir(str(out)).exists()


def test_extract_reads_the_output_as_is(workspace, regenerated):
    out, _ = regenerated
    summary = dry_run(ExtractConfig(model_path=str(workspace["target"]), data=(str(out),),
                                    out=str(workspace["root"] / "store")))
    assert summary.samples == 4 and summary.rejected == 0 and summary.loss_tokens > 0


def test_rerun_is_a_no_op_and_other_settings_need_overwrite(workspace, regenerated):
    out, _ = regenerated
    before = out.read_bytes()
    assert run_regenerate(_config(workspace, out)).state == "complete"
    assert out.read_bytes() == before
    other = _config(workspace, out)
    other = RegenerateConfig(**{**other.__dict__, "generate": GenerateConfig(**{**other.generate.__dict__,
                                                                                "max_new_tokens": 4})})
    with pytest.raises(ValueError, match="--overwrite"):
        run_regenerate(other)
    assert out.read_bytes() == before


def test_sigkill_of_the_driver_then_a_rerun_equals_an_uninterrupted_run(workspace, ray_address, tmp_path):
    """A real `regenerate` process killed after some chunks: no output appears, finished chunks are kept
    by the rerun, and the result is byte-identical to a run that was never interrupted."""
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: what is {i} plus {i}?"}) + "\n"
                            for i in range(24)))
    out = tmp_path / "answers.jsonl"
    args = ["regenerate", "--model", str(workspace["target"]), "--data", str(data), "--out", str(out),
            "--dtype", "float32", "--max-new-tokens", "8", "--batch-size", "1", "--chunk-size", "1",
            "--num-workers", "1", "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    driver = subprocess.Popen([str(Path(sys.executable).with_name("beagle-pipeline")), *args], env=env,
                              start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    work = partial_dir(str(out))
    try:
        deadline = time.monotonic() + 120
        while len(list(work.glob("chunk-*.jsonl"))) < 3 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert driver.poll() is None, driver.stdout.read().decode()[-2000:]
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)  # the local Ray it started, if anything outlived it
        except ProcessLookupError:
            pass
    kept = len(list(work.glob("chunk-*.jsonl")))
    assert 3 <= kept < 24, f"the kill came too late to test resume ({kept} chunks written)"
    assert not out.exists() and not manifest_path(str(out)).exists()

    result = CliRunner().invoke(main, [*args, "--address", ray_address])
    assert result.exit_code == 0, result.output
    resumed = re.search(r"resumed: (\d+) of 24 chunks", result.output)
    assert resumed and int(resumed.group(1)) >= kept, result.output
    reference = tmp_path / "reference.jsonl"
    result = CliRunner().invoke(main, [*args[:5], "--out", str(reference), *args[7:], "--address", ray_address])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == reference.read_bytes()
    assert [c["id"] for c in _lines(out)] == [f"p{i}" for i in range(24)]
    assert not work.exists()


def test_the_driver_reads_only_the_chunks_in_flight_before_the_first_one_is_committed(workspace, ray_address,
                                                                                      tmp_path, monkeypatch):
    """The prompts are streamed: when the first chunk is written, the driver has read at most the chunks the
    actors may hold (one actor, two in flight) and the one it was forming, not the 40 prompts. A driver that
    read every record first (`list(stream)`, as regenerate once did) fails this."""
    from pipeline.jobkit.record_stream import RecordStream
    from pipeline.regenerate import job
    from pipeline.store import atomic

    data = tmp_path / "forty.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}?"}) + "\n" for i in range(40)))
    read, at_first_commit = [], []

    class Counted(RecordStream):
        def __iter__(self):
            for record in super().__iter__():
                read.append(record.sample_id)
                yield record

    def counted_stream(*args, **kwargs):
        stream = real_stream(*args, **kwargs)
        stream.__class__ = Counted
        return stream

    def watched_write(path, text, **kwargs):
        if Path(path).name.startswith("chunk-") and not at_first_commit:
            at_first_commit.append(len(read))
        real_write(path, text, **kwargs)

    real_stream, real_write = job.stream_prompts, atomic.write_text
    monkeypatch.setattr(job, "stream_prompts", counted_stream)
    monkeypatch.setattr(atomic, "write_text", watched_write)
    config = _config(workspace, tmp_path / "answers.jsonl")
    config = RegenerateConfig(**{**config.__dict__, "data": (str(data),), "generate": GenerateConfig(
        **{**config.generate.__dict__, "max_new_tokens": 2})})
    summary = run_regenerate(config)
    assert summary.conversations == 40 and len(read) == 40
    chunk_size, in_flight = config.chunk_size, 2 * config.num_workers
    assert at_first_commit and at_first_commit[0] <= (in_flight + 1) * chunk_size, at_first_commit


def test_unfinished_work_from_other_settings_is_refused(workspace, ray_address):
    out = workspace["root"] / "other.jsonl"
    work = partial_dir(str(out))
    work.mkdir()
    (work / "identity.txt").write_text("something else\n")
    with pytest.raises(ValueError, match="unfinished work"):
        run_regenerate(_config(workspace, out))
    shutil.rmtree(work)


def test_a_second_job_into_the_same_output_is_refused(workspace, tmp_path):
    """While one job holds OUT.lock (flock; here this test holds it), another stops at once, naming it."""
    import fcntl

    from pipeline.jobkit.outputs import lock_path

    out = tmp_path / "busy.jsonl"
    with open(lock_path(str(out)), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="being written by another process"):
            run_regenerate(_config(workspace, out))
    assert not out.exists() and not partial_dir(str(out)).exists()


def test_max_turns_answers_only_the_first_turns(workspace):
    """Without Ray: the generator itself, on a two-turn record."""
    from pipeline.regenerate.generation import ConversationGenerator
    from pipeline.regenerate.prompts import PromptRecord

    record = PromptRecord("two", "x.jsonl", 0, (), ("The quick brown fox.", "Numbers 0123456789 please."))
    for max_turns, answers in ((1, 1), (0, 2), (5, 2)):
        generator = ConversationGenerator(GenerateConfig(model_path=str(workspace["target"]), dtype="float32",
                                                         max_new_tokens=4, max_turns=max_turns))
        [result] = generator.answer([record], seed=0)
        assert [m["role"] for m in result.messages] == ["user", "assistant"] * answers


def test_cli_help_and_one_line_errors(workspace, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["regenerate", "--help"])
    assert result.exit_code == 0 and "self-distillation" in result.output
    result = runner.invoke(main, ["regenerate", "--model", str(tmp_path / "nope"), "--data", str(workspace["data"]),
                                  "--out", str(tmp_path / "a.jsonl")])
    assert result.exit_code == 1 and "not a directory" in result.output
    result = runner.invoke(main, ["regenerate", "--model", str(workspace["target"]), "--data",
                                  str(workspace["data"]), "--out", str(tmp_path / "a.txt")])
    assert result.exit_code == 1 and "*.jsonl" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = runner.invoke(main, ["regenerate", "--model", str(workspace["target"]), "--data", str(empty),
                                  "--out", str(tmp_path / "a.jsonl")])
    assert result.exit_code == 1 and "no records in the input; nothing to regenerate" in result.output, result.output
    assert "all 0 records" not in result.output
