"""`regenerate --engine vllm` (vLLM's CPU build in .venv-vllm, a worker process) against `--engine hf`.

The slow test runs both engines through the real job on a local Ray, in fp32 greedy, on a tiny *trained*
Llama (tests/tiny_engine.py: head_dim 64, which vLLM's CPU attention takes, and peaky answers, so that no
near-tie lets two engines' kernels pick different tokens): the two output files are equal line for line
(answers, token counts, dropped turns), and so are the rejects, prompt_too_long included; the manifest
names the engine and its version. A crash after every chunk was answered is resumed without starting vLLM
again. Measured 2026-12-04 on 2 shared cores: 130-195 s for the file, ~35 s each vLLM start, ~12 s each probe.
The fast tests check the one-line refusals, which need no vLLM.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.regenerate.generation import GenerateConfig
from pipeline.regenerate.job import RegenerateConfig, manifest_path, partial_dir, rejects_path, run_regenerate
from tests.tiny import build_target
from tests.vllm_env import require_vllm

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("target") / "target", template="chatml")


def _invoke(*args: str):
    return CliRunner().invoke(main, ["regenerate", *args])


def test_vllm_options_need_the_vllm_engine(tiny_target, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "Hello"}\n')
    common = ["--model", str(tiny_target), "--data", str(data), "--out", str(tmp_path / "a.jsonl")]
    result = _invoke(*common, "--tensor-parallel-size", "2")
    assert result.exit_code == 1 and "add --engine vllm" in result.output, result.output
    result = _invoke(*common, "--engine", "vllm", "--num-gpus-per-worker", "2")
    assert result.exit_code == 1 and "--tensor-parallel-size x --pipeline-parallel-size" in result.output
    result = _invoke(*common, "--engine", "vllm")  # --max-prompt-length 2048 on a target of 512 positions
    assert result.exit_code == 1 and "give at most 511" in result.output, result.output


def test_a_missing_vllm_environment_is_one_line(tiny_target, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "Hello"}\n')
    result = _invoke("--model", str(tiny_target), "--data", str(data), "--out", str(tmp_path / "a.jsonl"),
                     "--engine", "vllm", "--vllm-python", str(tmp_path / "no-venv" / "bin" / "python"),
                     "--max-prompt-length", "100")
    assert result.exit_code == 1, result.output
    assert "no vLLM environment at" in result.output and "make serve-venv" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "a.jsonl").exists() and not partial_dir(str(tmp_path / "a.jsonl")).exists()


@pytest.mark.slow
def test_vllm_answers_equal_the_transformers_engines_token_for_token(tmp_path, monkeypatch):
    require_vllm()
    from tests.local_ray import local_ray
    from tests.tiny_engine import SENTENCES, build_engine_target, one_thread

    with one_thread():
        build_engine_target(tmp_path / "target")
    records = [{"id": f"s{k}", "turns": [sentence, SENTENCES[(k + 3) % len(SENTENCES)]]}
               for k, sentence in enumerate(SENTENCES)]
    records += [{"id": "long", "prompt": " ".join(SENTENCES) * 3},        # over --max-prompt-length: rejected
                {"id": "grows", "turns": [SENTENCES[0], " ".join(SENTENCES) * 2]}]  # its second turn is dropped
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"prompt": \n')
    outs = {engine: tmp_path / f"{engine}.jsonl" for engine in ("hf", "vllm")}

    def config(engine: str) -> RegenerateConfig:
        generate = GenerateConfig(model_path=str(tmp_path / "target"), dtype="float32", max_new_tokens=24,
                                  max_prompt_length=160, batch_size=4, engine=engine)
        return RegenerateConfig(generate=generate, data=(str(data),), out=str(outs[engine]), chunk_size=4,
                                num_workers=1)

    with local_ray(num_cpus=2):
        summaries = {"hf": run_regenerate(config("hf"))}
        from pipeline.regenerate import job

        real_assemble = job._assemble

        def crash(*args, **kwargs):
            raise KeyboardInterrupt("killed after every chunk was answered")

        monkeypatch.setattr(job, "_assemble", crash)
        with pytest.raises(KeyboardInterrupt):
            run_regenerate(config("vllm"))
        assert len(list(partial_dir(str(outs["vllm"])).glob("chunk-*.jsonl"))) == 3 and not outs["vllm"].exists()
        monkeypatch.setattr(job, "_assemble", real_assemble)
        monkeypatch.setattr(job, "_dispatcher", lambda *a, **k: pytest.fail("the resumed run started an engine"))
        summaries["vllm"] = run_regenerate(config("vllm"))

    lines = {engine: [json.loads(line) for line in out.read_text().splitlines()] for engine, out in outs.items()}
    assert lines["vllm"] == lines["hf"]  # answers, token counts, unfinished and dropped turns, in input order
    assert [c["id"] for c in lines["hf"]] == [*(f"s{k}" for k in range(len(SENTENCES))), "grows"]
    assert lines["hf"][-1]["regenerated"]["dropped_turns"] == 1
    assert summaries["hf"].generated_tokens > 100 and summaries["vllm"].chunks_resumed == 3
    assert rejects_path(str(outs["vllm"])).read_text() == rejects_path(str(outs["hf"])).read_text()
    assert [json.loads(r)["reason"] for r in rejects_path(str(outs["vllm"])).read_text().splitlines()] == [
        "prompt_too_long", "malformed_json"]
    manifests = {engine: json.loads(manifest_path(str(out)).read_text()) for engine, out in outs.items()}
    made_by = {engine: manifest["generated_by"] for engine, manifest in manifests.items()}
    assert made_by["vllm"]["name"] == "vllm" and made_by["vllm"]["version"] == "0.32.0"
    assert made_by["vllm"]["tensor_parallel_size"] == made_by["vllm"]["pipeline_parallel_size"] == 1
    assert manifests["vllm"]["engine"] == {"name": "vllm", "version": "0.32.0"}  # part of its identity
    assert made_by["hf"]["name"] == "hf" and made_by["hf"]["version"] and "engine" not in manifests["hf"]
    assert manifests["vllm"]["identity_sha256"] != manifests["hf"]["identity_sha256"]
    assert manifests["vllm"]["counts"] == manifests["hf"]["counts"]

    # An architecture vLLM does not have is refused before any Ray worker, in one line.
    other = tmp_path / "other"
    other.mkdir()
    for path in (tmp_path / "target").iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    config_json = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config_json, "architectures": ["NoSuchModelForCausalLM"]}))
    result = _invoke("--model", str(other), "--data", str(data), "--out", str(tmp_path / "x.jsonl"),
                     "--engine", "vllm", "--max-prompt-length", "160")
    assert result.exit_code == 1 and "does not run the architecture NoSuchModelForCausalLM" in result.output, \
        result.output
