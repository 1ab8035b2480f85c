"""The architecture sweep: every family we claim, end to end on a tiny random model built here.

Each family costs ~10 s on 2 cores, nearly all of it the extraction actor's start (a fresh process that
imports torch and transformers); training 3 steps and both evaluations take ~2 s.

For each family: extract a few conversations (texts, for a base model without a chat template) on a real
local Ray -> train 3 steps -> `eval` greedy with a chain and a tree, whose outputs must equal plain
decoding (fp32). A family that cannot work must be refused at start, with its reason asserted here.
docs/models.md lists the families and what each exercises.
"""
import json

import pytest
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

from beagle.train_config import TrainConfig
from beagle.trainer import train
from pipeline.cli import main
from pipeline.extract.pipeline import ExtractConfig, run_extract
from tests.decoding_helpers import write_jsonl
from tests.local_ray import local_ray
from tests.tiny import VOCAB_SIZE, build_tokenizer
from tests.tiny_families import FAMILIES, LLAMA_LIKE, family_model

pytestmark = pytest.mark.slow

CHATS = [{"id": f"c{i}", "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
         for i, (question, answer) in enumerate([
             ("What is the capital of France?", "The capital of France is Paris. Hello, how are you today?"),
             ("Write a short poem about the sea.", "The quick brown fox jumps over the lazy dog. I am fine."),
             ("Hello, how are you today?", "I am fine, thank you. Here is a list: 1, 2, 3. Numbers 0123456789."),
             ("Sure! Here is a list: 1, 2, 3.", "What is the capital of France? Paris, the capital of France."),
         ])]
TEXTS = [{"id": f"t{i}", "text": " ".join([chat["conversations"][0]["value"], chat["conversations"][1]["value"]] * 2)}
         for i, chat in enumerate(CHATS)]
TRAIN = dict(batch_tokens=256, lr=3e-3, warmup_steps=1, window_size=3, simulation_steps=2, vocab_chunk=128,
             max_steps=3, checkpoint_every=100, device="cpu")


@pytest.fixture(scope="module")
def ray_address():
    with local_ray(num_cpus=2) as address:
        yield address


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-data")
    return {"chats": write_jsonl(root / "chats.jsonl", CHATS), "texts": write_jsonl(root / "texts.jsonl", TEXTS),
            "chat_prompts": write_jsonl(root / "chat_prompts.jsonl", [{"prompt": "What is the capital of France?"},
                                                                       {"prompt": "Write a short poem"}]),
            "text_prompts": write_jsonl(root / "text_prompts.jsonl", [{"text": "The quick brown fox"},
                                                                       {"text": "Hello, how are"}])}


def build_family(directory, family: str) -> bool:
    """A tiny random model of `family` with the test tokenizer, saved in `directory`; True for a base model."""
    template = FAMILIES[family][2]
    tokenizer = build_tokenizer(directory, template=template)
    family_model(family, max(VOCAB_SIZE, len(tokenizer)), bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(str(directory))
    return template is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_extract_train_and_eval_equal_plain_decoding(family, tmp_path, data, ray_address):
    target, store = tmp_path / "target", tmp_path / "store"
    base = build_family(target, family)
    summary = run_extract(ExtractConfig(model_path=str(target), data=(str(data["texts" if base else "chats"]),),
                                        out=str(store), dtype="float32", max_length=128, num_workers=1,
                                        address=ray_address))
    assert summary.samples == 4 and summary.rejected == 0
    train([str(store)], tmp_path / "run", TrainConfig(**TRAIN))
    prompts = data["text_prompts" if base else "chat_prompts"]
    for shape in (["--chain", "--depth", "3"], ["--tree", "--depth", "3", "--top-k", "3", "--total-tokens", "8"]):
        report = tmp_path / f"eval-{shape[0]}.json"
        result = CliRunner().invoke(main, [
            "eval", "--model", str(target), "--drafter", str(tmp_path / "run" / "drafter"), "--prompts", str(prompts),
            "--max-new-tokens", "24", *shape, "--json", str(report), "--no-progress"])
        assert result.exit_code == 0, f"{family} {shape[0]}: {result.output}"
        assert json.loads(report.read_text())["outputs_match"] is True, family


def test_a_family_whose_cache_cannot_be_cut_back_is_refused_by_eval_at_start(tmp_path, data):
    """Qwen3-Next's linear-attention layers keep a running state: rejected drafts cannot be removed from it."""
    tokenizer = build_tokenizer(tmp_path, template="chatml")
    config = AutoConfig.for_model("qwen3_next", vocab_size=max(VOCAB_SIZE, len(tokenizer)), **LLAMA_LIKE, head_dim=16,
                                  linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                  linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    result = CliRunner().invoke(main, ["eval", "--model", str(tmp_path), "--drafter", str(tmp_path),  # never read
                                       "--prompts", str(data["chat_prompts"]), "--no-progress"])
    assert result.exit_code != 0
    assert "Qwen3NextForCausalLM has linear_attention layers" in result.output
    assert "Traceback" not in result.output
