"""`beagle-pipeline eval` end to end on a tiny saved target, tokenizer and drafter; prompt files."""
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from beagle.drafter_folder import save_drafter
from beagle.prompts import PromptItem, eos_token_ids, load_prompts, render
from pipeline.cli import main
from tests.decoding_helpers import bigram_drafter, chat_tokenizer_dir, random_drafter, tiny_target, write_jsonl

WORDS = 40  # tokenizer vocabulary = WORDS + 6 specials


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tokenizer = chat_tokenizer_dir(root / "target", words=WORDS)
    target = tiny_target(vocab_size=len(tokenizer), context_scale=0.15, seed=2)
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.save_pretrained(root / "target")
    save_drafter(root / "run" / "drafter", bigram_drafter(target), metadata={"target": {"name": "tiny"}})
    prompts = write_jsonl(root / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["w1 w2 w3", "w4 w5"]},
        {"question_id": 82, "category": "math", "turns": ["w7 w7 w9 w10 w11"]},
        {"prompt": "w20 w21"},
        {"messages": [{"role": "system", "content": "w30"}, {"role": "user", "content": "w31 w32"},
                      {"role": "assistant", "content": "w33"}]},
    ])
    return root, prompts, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("shape", [["--chain", "--depth", "4"], ["--tree", "--depth", "4", "--top-k", "3",
                                                                  "--total-tokens", "10"]])
def test_eval_greedy_matches_plain_and_writes_json_and_plot(setup, shape):
    root, prompts, _ = setup
    out = root / f"out-{shape[0]}"
    result = CliRunner().invoke(main, [
        "eval", "--model", str(root / "target"), "--drafter", str(root / "run" / "drafter"),
        "--prompts", str(prompts), "--max-new-tokens", "24", *shape, "--json", str(out / "eval.json"),
        "--answers", str(out / "answers.jsonl"),
        "--plot", str(out / "acceptance.png"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "outputs match plain greedy decoding" in result.output
    report = json.loads((out / "eval.json").read_text())
    assert report["outputs_match"] is True and report["num_prompts"] == 4 and report["max_new_tokens"] == 24
    assert report["answers_compared"] == 5  # every turn of every prompt: 2 + 1 + 1 + 1
    assert len(report["per_depth_acceptance"]) == 4
    assert report["acceptance_length"] > 1.2  # the bigram drafter is often right about this target
    assert report["tokens_per_second"]["baseline"] > 0 and report["tokens_per_second"]["speculative"] > 0
    assert report["speedup"] == pytest.approx(report["tokens_per_second"]["speculative"]
                                              / report["tokens_per_second"]["baseline"])
    assert (out / "acceptance.png").stat().st_size > 1000
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [(a["prompt_id"], a["turn"]) for a in answers][:3] == [("81", 1), ("81", 2), ("82", 1)]
    assert len(answers) == 5 and all(a["baseline"] == a["speculative"] for a in answers)


@pytest.mark.slow
def test_eval_sampling_runs_and_limit_applies(setup):
    root, prompts, _ = setup
    result = CliRunner().invoke(main, [
        "eval", "--model", str(root / "target"), "--drafter", str(root / "run" / "drafter"),
        "--prompts", str(prompts), "--max-new-tokens", "8", "--temperature", "0.7", "--limit", "2",
        "--depth", "3", "--top-k", "2", "--total-tokens", "4", "--json", str(root / "s.json"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert json.loads((root / "s.json").read_text())["num_prompts"] == 2


def test_eval_refuses_a_drafter_for_another_vocabulary(setup, tmp_path):
    root, prompts, _ = setup
    other = tiny_target(vocab_size=80)
    save_drafter(tmp_path / "drafter", random_drafter(other), metadata={})
    result = CliRunner().invoke(main, ["eval", "--model", str(root / "target"), "--drafter",
                                       str(tmp_path / "drafter"), "--prompts", str(prompts), "--no-progress"])
    assert result.exit_code == 1  # a data error: the drafter does not fit this target
    assert "vocab_size=80" in result.output and "--model" in result.output


def test_prompt_formats(setup, tmp_path):
    root, prompts, tokenizer = setup
    items = load_prompts(prompts).items
    assert [item.turns for item in items] == [("w1 w2 w3", "w4 w5"), ("w7 w7 w9 w10 w11",), ("w20 w21",),
                                              ("w31 w32",)]
    assert items[0].prompt_id == "81"
    assert items[3].history == ({"role": "system", "content": "w30"},)  # the stored answer was dropped
    assert len(load_prompts(prompts, limit=2).items) == 2
    ids = render(tokenizer, [{"role": "user", "content": "w1 w2"}])
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|user|>", "w1", "w2", "<|end|>", "<|assistant|>"]
    assert eos_token_ids(tokenizer) == {tokenizer.eos_token_id}
    for bad, message in (({"title": "x"}, "missing_field"), ({"text": " "}, "empty_text"),
                         ({"turns": []}, "empty_conversation"),
                         ({"messages": [{"role": "assistant", "content": "x"}]}, "no_user_turn")):
        with pytest.raises(ValueError, match=message):
            load_prompts(write_jsonl(tmp_path / "bad.jsonl", [bad]))
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:1"):
        load_prompts(tmp_path / "broken.jsonl")


def test_multi_turn_carries_each_sides_answer(setup):
    from beagle.decoding import DraftConfig
    from beagle.decoding.evaluation import evaluate_prompts
    from transformers import AutoModelForCausalLM

    root, _, tokenizer = setup
    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    drafter = bigram_drafter(target)
    item = PromptItem("q", (), ("w1 w2 w3", "w4 w5"))
    summary = evaluate_prompts(target, drafter, tokenizer, [item], DraftConfig.chain(3), 6, set(), keep_answers=True)
    assert not summary.mismatches and [a["turn"] for a in summary.answers] == [1, 2]
    first_answer = summary.answers[0]["baseline"]
    second_prompt = render(tokenizer, [{"role": "user", "content": "w1 w2 w3"},
                                       {"role": "assistant", "content": first_answer},
                                       {"role": "user", "content": "w4 w5"}])
    from beagle.decoding import plain_generate
    expected = plain_generate(target, torch.tensor(second_prompt), 6, set()).tokens
    assert summary.answers[1]["baseline"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert summary.baseline.tokens == 12 and summary.speculative.tokens == 12


@pytest.mark.slow
def test_eval_with_a_reduced_draft_vocabulary(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny_store import build_tiny_store

    root, prompts, _ = setup
    target = AutoModelForCausalLM.from_pretrained(root / "target")
    store = build_tiny_store(tmp_path / "store", model=target, num_samples=6)
    base = ["eval", "--model", str(root / "target"), "--drafter", str(root / "run" / "drafter"), "--prompts",
            str(prompts), "--max-new-tokens", "12", "--chain", "--draft-vocab", "20", "--no-progress"]
    result = CliRunner().invoke(main, base)
    assert result.exit_code == 2 and "--draft-vocab-store" in result.output  # the drafter lists no stores
    result = CliRunner().invoke(main, base + ["--draft-vocab-store", store])
    assert result.exit_code == 0, result.output
    assert "outputs match plain greedy decoding" in result.output


@pytest.mark.slow
def test_eval_drafts_over_the_vocabulary_the_drafter_was_trained_on(setup, tmp_path):
    root, prompts, tokenizer = setup
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "target")
    save_drafter(tmp_path / "drafter", bigram_drafter(model),
                 metadata={"target": {"name": "tiny"}, "draft_vocab": list(range(6, 26))})
    base = ["eval", "--model", str(root / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts",
            str(prompts), "--max-new-tokens", "12", "--chain", "--no-progress"]
    result = CliRunner().invoke(main, base)
    assert result.exit_code == 0, result.output
    assert "drafting over the 21-token vocabulary" in result.output  # 20 trained ids + EOS
    assert "outputs match plain greedy decoding" in result.output
    result = CliRunner().invoke(main, base + ["--draft-vocab", "0"])
    assert result.exit_code == 0 and "drafting over" not in result.output


@pytest.mark.slow
def test_eval_runs_an_eagle2_baseline_drafter(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    from beagle.eagle2 import Eagle2Drafter
    from beagle.model import DrafterConfig

    root, prompts, _ = setup
    target = AutoModelForCausalLM.from_pretrained(root / "target")
    drafter = Eagle2Drafter(DrafterConfig.from_architecture(target.config.to_dict()),
                            target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach())
    save_drafter(tmp_path / "drafter", drafter, metadata={})
    result = CliRunner().invoke(main, ["eval", "--model", str(root / "target"), "--drafter", str(tmp_path / "drafter"),
                                       "--prompts", str(prompts), "--max-new-tokens", "12", "--depth", "3",
                                       "--top-k", "3", "--total-tokens", "8", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "outputs match plain greedy decoding" in result.output


def test_the_drafter_reads_the_targets_own_embedding_and_head_without_a_copy(setup):
    from beagle.decoding.loading import load_drafter_for, load_target

    root, _, _ = setup
    model, _ = load_target(root / "target", "float32", torch.device("cpu"))
    drafter, _ = load_drafter_for(root / "run" / "drafter", model, "float32", torch.device("cpu"))
    assert drafter.lm_head.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert drafter.embed_tokens.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    bf16, _ = load_drafter_for(root / "run" / "drafter", model, "bfloat16", torch.device("cpu"))
    assert bf16.lm_head.dtype == torch.bfloat16 and model.get_output_embeddings().weight.dtype == torch.float32


@pytest.mark.parametrize("dtype, strict, fails", [("float32", None, True), ("bfloat16", None, False),
                                                   ("float16", None, False), ("bfloat16", True, True),
                                                   ("float32", False, False)])
def test_differing_greedy_answers_fail_in_float32_and_are_reported_in_half_precision(dtype, strict, fails, capsys):
    """Half precision rounds a one-token and a many-token pass differently, so there a differing answer is
    counted, not fatal; in float32 it is a bug and exits 1 (each default overridable with --strict)."""
    from types import SimpleNamespace

    from pipeline.commands.eval import _report_greedy_equality

    summary = SimpleNamespace(mismatches=["prompt 81 turn 1: outputs differ from token 7"], answers_compared=5)
    if fails:
        with pytest.raises(SystemExit) as exit_info:
            _report_greedy_equality(summary, dtype, strict)
        assert exit_info.value.code == 1
        assert "MISMATCH prompt 81 turn 1" in capsys.readouterr().err
    else:
        _report_greedy_equality(summary, dtype, strict)
        output = capsys.readouterr()
        assert f"1 of 5 answer(s) differ from plain greedy decoding in {dtype}" in output.out
        assert "differs prompt 81 turn 1" in output.err
    _report_greedy_equality(SimpleNamespace(mismatches=[], answers_compared=5), dtype, strict)
    assert "outputs match plain greedy decoding token for token" in capsys.readouterr().out


def test_eval_runs_a_target_that_ships_its_own_code_only_with_trust_remote_code(setup, tmp_path):
    """A target whose model_type only its own code knows (auto_map -> custom.py, which leaves a marker when
    imported): `eval` refuses it, naming --trust-remote-code, without running that code; with the flag the
    code runs and the drafter decodes it exactly as plain decoding does."""
    import shutil

    root, prompts, _ = setup
    target = tmp_path / "custom-target"
    shutil.copytree(root / "target", target)
    marker = tmp_path / "executed"
    (target / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="custom-llama", architectures=["CustomModel"],
                  auto_map={"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"})
    (target / "config.json").write_text(json.dumps(config))
    base = ["eval", "--model", str(target), "--drafter", str(root / "run" / "drafter"), "--prompts", str(prompts),
            "--max-new-tokens", "8", "--chain", "--depth", "2", "--limit", "1", "--no-progress"]

    refused = CliRunner().invoke(main, base)
    assert refused.exit_code != 0 and "--trust-remote-code" in refused.output, refused.output
    assert not marker.exists()
    result = CliRunner().invoke(main, base + ["--trust-remote-code"])
    assert result.exit_code == 0, result.output
    assert marker.exists() and "outputs match plain greedy decoding" in result.output


def test_eval_reads_a_parquet_prompt_file_and_reports_the_records_it_skips(setup, tmp_path):
    """eval reads what extract reads (here Parquet, with OpenAI content parts) and skips a bad record
    aloud, naming its file and reason, instead of failing the run or dropping it silently."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, _, _ = setup
    rows = [{"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "w1 "},
                                                                     {"type": "text", "text": "w2"}]}]},
            {"id": "bad", "messages": [{"role": "tool", "content": [{"type": "text", "text": "w3"}]}]},
            {"id": "plain", "messages": [{"role": "user", "content": [{"type": "text", "text": "w4 w5"}]}]}]
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    result = CliRunner().invoke(main, [
        "eval", "--model", str(root / "target"), "--drafter", str(root / "run" / "drafter"), "--prompts", str(path),
        "--max-new-tokens", "6", "--chain", "--depth", "2", "--json", str(tmp_path / "e.json"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "skipped 1 prompt record(s) that cannot be asked (no_user_turn 1)" in result.output
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["num_prompts"] == 2 and [r["index"] for r in report["rejected_prompts"]] == [1]


def test_eval_reports_by_category_with_attempts_and_draws_the_chart(setup):
    """`--by category` (the default): τ, α per depth with attempts and speedup per MT-Bench category, the
    records without one as their own group; the groups' counts add up to the total; a chart beside --json."""
    root, prompts, _ = setup
    out = root / "by"
    result = CliRunner().invoke(main, [
        "eval", "--model", str(root / "target"), "--drafter", str(root / "run" / "drafter"), "--prompts",
        str(prompts), "--max-new-tokens", "16", "--chain", "--depth", "3", "--json", str(out / "eval.json"),
        "--plot", str(out / "depths.png"), "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    groups = report["by"]["groups"]
    assert report["by"]["field"] == "category" and list(groups) == ["writing", "math", "(no group)"]
    assert [g["prompts"] for g in groups.values()] == [1, 1, 2]
    for key in ("target_passes",):
        assert sum(g[key] for g in groups.values()) == report[key]["speculative"]
    for depth, total in enumerate(report["per_depth_attempts"]):
        assert sum(g["per_depth_attempts"][depth] for g in groups.values() if g["per_depth_attempts"]) == total
    assert report["per_depth_few_attempts"] == [0 < n < report["few_attempts"] for n in report["per_depth_attempts"]]
    lines = result.output.splitlines()
    by = lines.index(next(line for line in lines if line.startswith("by category")))
    assert [line.split()[0] for line in lines[by + 1:by + 4]] == ["writing", "math", "(no"]
    assert "(n=" in lines[by + 1] and "*" in result.output  # every α has its attempts; a handful is marked rough
    assert (out / "eval-by-category.png").stat().st_size > 1000 and (out / "depths.png").stat().st_size > 1000

    result = CliRunner().invoke(main, [
        "eval", "--model", str(root / "target"), "--drafter", str(root / "run" / "drafter"), "--prompts",
        str(prompts), "--max-new-tokens", "8", "--chain", "--depth", "2", "--by", "", "--json",
        str(out / "flat.json"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "flat.json").read_text())["by"] is None and "by category" not in result.output
    assert not (out / "flat-by-.png").exists()


def test_a_group_chart_is_named_beside_its_report_whatever_the_field():
    from pipeline.commands.acceptance_plots import group_chart_path
    assert group_chart_path(Path("out/eval.json"), "category") == Path("out/eval-by-category.png")
    assert group_chart_path(Path("out/serve.json"), "meta/source", infix="float32") == Path(
        "out/serve-float32-by-meta_source.png")
