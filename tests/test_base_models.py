"""Base models (no chat template): `{"text": ...}` prompts are continued as they are, in `eval` and in
`regenerate`, and conversations are refused up front for them with the fix named."""
import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from beagle.drafter_folder import save_drafter
from beagle.prompts import load_prompts, render
from pipeline.cli import main
from pipeline.jobkit.target import load_tokenizer
from pipeline.extract.pipeline import ExtractConfig, dry_run
from pipeline.regenerate.generation import GenerateConfig
from pipeline.regenerate.job import RegenerateConfig, run_regenerate
from tests.decoding_helpers import random_drafter, write_jsonl
from tests.local_ray import local_ray
from tests.tiny import build_target

TEXTS = [{"id": "fox", "text": "The quick brown fox"}, {"id": "paris", "text": "The capital of France is"},
         {"text": "Numbers 0123456789 and"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    target = build_target(root / "target", template=None)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    save_drafter(root / "drafter", random_drafter(model), metadata={"target": {"name": "base"}})
    return {"root": root, "target": target, "model": model, "tokenizer": load_tokenizer(str(target)),
            "texts": write_jsonl(root / "texts.jsonl", TEXTS)}


def _greedy(model, ids: list[int], new_tokens: int, eos: int) -> list[int]:
    with torch.inference_mode():
        row = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=eos)[0, len(ids):].tolist()
    return row[:row.index(eos)] if eos in row else row


def test_a_text_prompt_is_tokenized_as_it_is(base):
    tokenizer = base["tokenizer"]
    assert not getattr(tokenizer, "chat_template", None)
    items = load_prompts(base["texts"]).items
    assert [(item.prompt_id, item.text, item.turns) for item in items][0] == ("fox", True, ("The quick brown fox",))
    ids = render(tokenizer, [{"role": "text", "content": "The quick brown fox"}])
    assert ids == tokenizer("The quick brown fox")["input_ids"]


@pytest.mark.parametrize("shape", [["--chain", "--depth", "3"], ["--tree", "--depth", "3", "--top-k", "3",
                                                                  "--total-tokens", "8"]])
def test_eval_continues_text_prompts_on_a_base_model_identically(base, shape):
    out = base["root"] / f"eval-{shape[0]}.json"
    result = CliRunner().invoke(main, [
        "eval", "--model", str(base["target"]), "--drafter", str(base["root"] / "drafter"), "--prompts",
        str(base["texts"]), "--max-new-tokens", "12", *shape, "--json", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["outputs_match"] is True and report["num_prompts"] == 3


def test_regenerate_refuses_conversations_for_a_base_model_before_any_worker(base):
    data = write_jsonl(base["root"] / "mixed.jsonl", [*TEXTS, {"id": "chat", "prompt": "Hello"}])
    config = RegenerateConfig(generate=GenerateConfig(model_path=str(base["target"]), dtype="float32"),
                              data=(str(data),), out=str(base["root"] / "refused.jsonl"))
    with pytest.raises(ValueError, match=r"no chat template.*mixed.jsonl record 3.*\{\"text\": \.\.\.\}"):
        run_regenerate(config)  # no Ray is running in this test: the refusal comes before any worker
    assert not (base["root"] / "refused.jsonl").exists()


@pytest.mark.slow
def test_regenerate_continues_text_records_and_extract_reads_them(base):
    out = base["root"] / "continued.jsonl"
    generate = GenerateConfig(model_path=str(base["target"]), dtype="float32", max_new_tokens=8, batch_size=2)
    with local_ray(num_cpus=2):
        summary = run_regenerate(RegenerateConfig(generate=generate, data=(str(base["texts"]),), out=str(out),
                                                  num_workers=1))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer, model = base["tokenizer"], base["model"]
    assert [line["id"] for line in lines][:2] == ["fox", "paris"] and summary.turns == 3
    for record, line in zip(TEXTS, lines):
        assert "messages" not in line and line["text"].startswith(record["text"])
        ids = tokenizer(record["text"])["input_ids"]
        expected = tokenizer.decode(ids + _greedy(model, ids, 8, tokenizer.eos_token_id), skip_special_tokens=True)
        assert line["text"] == record["text"] + expected[len(tokenizer.decode(ids, skip_special_tokens=True)):]
    store = dry_run(ExtractConfig(model_path=str(base["target"]), data=(str(out),),
                                  out=str(base["root"] / "store")))
    assert store.samples == 3 and store.rejected == 0 and store.loss_tokens > 0
