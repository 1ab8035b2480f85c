"""Loss masks: 1 exactly on the assistant turns' tokens, for templates with and without generation markers."""
import numpy as np
import pytest

from pipeline.extract.chat import has_generation_markers, tokenize_record
from pipeline.jobkit.target import load_tokenizer
from pipeline.extract.inputs import Record, RejectRecord
from tests.tiny import build_tokenizer

TURNS = (("system", "Be brief."), ("user", "Hello there"), ("assistant", "Hi! How are you?"),
         ("user", "fine, thanks"), ("assistant", "Good. Bye!"))
END_OF_TURN = {"chatml_generation": "<|im_end|>", "chatml": "<|im_end|>", "zephyr": "</s>"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for name in END_OF_TURN:
        build_tokenizer(root / name, template=name)
        out[name] = load_tokenizer(str(root / name))
    return out


def _masked_segments(tokenizer, ids, mask):
    segments, current = [], []
    for token, flag in zip(ids.tolist(), mask.tolist()):
        if flag:
            current.append(token)
        elif current:
            segments.append(tokenizer.decode(current))
            current = []
    if current:
        segments.append(tokenizer.decode(current))
    return segments


@pytest.mark.parametrize("name", list(END_OF_TURN))
def test_mask_covers_exactly_the_assistant_turns(tokenizers, name):
    tokenizer = tokenizers[name]
    assert has_generation_markers(tokenizer) == (name == "chatml_generation")
    out = tokenize_record(tokenizer, Record("x", "f", 0, messages=TURNS), max_length=1000)
    full = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in TURNS], tokenize=False)
    assert tokenizer.decode(out.input_ids.tolist()) == full
    assert out.input_ids.dtype == np.int32 and out.loss_mask.dtype == bool and not out.truncated
    assert _masked_segments(tokenizer, out.input_ids, out.loss_mask) == [
        "Hi! How are you?" + END_OF_TURN[name], "Good. Bye!" + END_OF_TURN[name]]


def test_prefix_diff_agrees_with_generation_markers(tokenizers):
    record = Record("x", "f", 0, messages=TURNS)
    marked = tokenize_record(tokenizers["chatml_generation"], record, max_length=1000)
    diffed = tokenize_record(tokenizers["chatml"], record, max_length=1000)
    np.testing.assert_array_equal(marked.input_ids, diffed.input_ids)
    np.testing.assert_array_equal(marked.loss_mask, diffed.loss_mask)


def test_truncation_is_counted_and_a_sample_without_loss_tokens_is_rejected(tokenizers):
    tokenizer = tokenizers["chatml"]
    full = tokenize_record(tokenizer, Record("x", "f", 0, messages=TURNS), max_length=1000)
    first_loss = int(np.argmax(full.loss_mask))
    cut = tokenize_record(tokenizer, Record("x", "f", 0, messages=TURNS), max_length=first_loss + 2)
    assert cut.truncated and len(cut.input_ids) == first_loss + 2 and cut.loss_mask.sum() == 2
    with pytest.raises(RejectRecord) as info:
        tokenize_record(tokenizer, Record("x", "f", 0, messages=TURNS), max_length=first_loss)
    assert info.value.reason == "no_loss_tokens"


def test_text_records_learn_every_non_special_token(tokenizers):
    out = tokenize_record(tokenizers["chatml"], Record("t", "f", 0, text="The quick brown fox."), max_length=100)
    assert out.loss_mask.all() and tokenizers["chatml"].decode(out.input_ids.tolist()) == "The quick brown fox."


def test_template_errors_and_history_rewriting_templates_are_rejected(tmp_path):
    raising = "{{ raise_exception('roles must alternate') }}"
    build_tokenizer(tmp_path / "raising", template=raising)
    with pytest.raises(RejectRecord) as info:
        tokenize_record(load_tokenizer(str(tmp_path / "raising")), Record("x", "f", 0, messages=TURNS), max_length=99)
    assert info.value.reason == "template_error" and "roles must alternate" in info.value.detail
    # Shows only the latest assistant turn in full, like templates that strip earlier reasoning.
    rewriting = ("{%- for m in messages %}{{- m['role'] + ': ' }}"
                 "{%- if m['role'] == 'assistant' and not loop.last %}...{% else %}{{- m['content'] }}{% endif %}"
                 "{{- '\n' }}{%- endfor %}{%- if add_generation_prompt %}assistant: {% endif %}")
    build_tokenizer(tmp_path / "rewriting", template=rewriting)
    with pytest.raises(RejectRecord) as info:
        tokenize_record(load_tokenizer(str(tmp_path / "rewriting")), Record("x", "f", 0, messages=TURNS), max_length=99)
    assert info.value.reason == "template_not_prefix_stable"


def test_an_unreadable_tokenizer_fails_naming_the_directory(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"--model {tmp_path}: cannot load its tokenizer"):
        load_tokenizer(str(tmp_path))


TRIMMING = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def _conversation(turns: int, seed: int, size: int = 40) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", " ", "\n", "{{x}}", "<|im_end|>", "é", "😀", "  pad  ", "end."]
    messages = [{"role": "system", "content": "Be brief."}] if seed % 2 else []
    for i in range(turns):
        text = "".join(rng.choice(words) for _ in range(int(rng.integers(0, size))))
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


@pytest.mark.parametrize("name", [*END_OF_TURN, "trimming"])
def test_the_linear_skeleton_path_finds_the_same_spans_as_prefix_renders(tokenizers, tmp_path, name):
    """Loss masks come from rendering the conversation's prefixes (exact, quadratic) or from a skeleton of
    short marks (linear) whenever it proves itself exact: both must give the same spans, and a template
    that trims contents falls back to the prefix renders."""
    from pipeline.extract import chat

    if name == "trimming":
        build_tokenizer(tmp_path / name, template=TRIMMING)
        tokenizer = load_tokenizer(str(tmp_path / name))
    else:
        tokenizer = tokenizers[name]
    used = 0
    for seed in range(12):
        messages = _conversation(2 + seed * 5, seed)
        full = chat._render(tokenizer, messages, generation_prompt=False)
        exact = chat._spans_from_prefixes(tokenizer, messages, full)
        skeleton = chat._spans_from_skeleton(tokenizer, messages, full)
        if skeleton is not None:
            assert skeleton == exact
            used += 1
        assert chat._assistant_spans(tokenizer, messages, full) == exact
    if name == "trimming":
        assert used < 12  # contents with outer whitespace are trimmed: not verbatim, so the prefix renders
    else:
        assert used == 12


def test_finding_loss_masks_renders_each_content_a_fixed_number_of_times(tokenizers, monkeypatch):
    """60 turns of 20 kB each: the characters rendered grow linearly with the conversation (the prefix
    renders would render ~30 times its length)."""
    from pipeline.extract import chat

    tokenizer = tokenizers["chatml"]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "x" * 20_000}
                for i in range(60)]
    rendered = []
    real = chat._render
    monkeypatch.setattr(chat, "_render", lambda *a, **k: rendered.append(len(out := real(*a, **k))) or out)
    ids, mask = chat.tokenize_chat(tokenizer, messages)
    full = sum(len(m["content"]) for m in messages)
    assert sum(rendered) < 1.2 * full, (sum(rendered), full)
    assert mask.sum() > 0.4 * len(ids)
