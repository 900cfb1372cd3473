"""Assistant-only labels, checked token by token on a known (ChatML, byte-level) template."""

from __future__ import annotations

import pytest

from mtp_train.data.template import IGNORE, render_batch, render_prompt
from mtp_train.errors import DataError

CONV = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def _expected(tok, pieces):
    """Token ids and labels built piece by piece: (text, trained?) with special tokens as themselves."""
    ids, labels = [], []
    for text, trained in pieces:
        piece_ids = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        labels += piece_ids if trained else [IGNORE] * len(piece_ids)
    return ids, labels


def test_labels_cover_exactly_the_answers_and_their_end_of_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    ids, labels, errors = render_batch(tok, [CONV], max_length=1000)
    assert errors == [""]
    exp_ids, exp_labels = _expected(tok, [
        ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", False),
        ("<|im_start|>user\nhi<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("yo!", True), ("<|im_end|>", True), ("\n", False),
        ("<|im_start|>user\n2+2?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("4", True), ("<|im_end|>", True), ("\n", False),
    ])
    assert ids[0] == exp_ids
    assert labels[0] == exp_labels
    trained = [t for t in labels[0] if t != IGNORE]
    assert tok.decode(trained) == "yo!<|im_end|>4<|im_end|>"
    assert trained.count(tok.eos_token_id) == 2


def test_truncation_keeps_labels_aligned(tiny_tokenizer):
    full_ids, full_labels, _ = render_batch(tiny_tokenizer, [CONV], max_length=1000)
    cut = len(full_ids[0]) - 6  # inside the second answer's tail
    ids, labels, _ = render_batch(tiny_tokenizer, [CONV], max_length=cut)
    assert ids[0] == full_ids[0][:cut] and labels[0] == full_labels[0][:cut]


def test_batch_equals_one_by_one(tiny_tokenizer):
    other = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "a"}]
    batch = render_batch(tiny_tokenizer, [CONV, other], 1000)
    assert batch[0][1] == render_batch(tiny_tokenizer, [other], 1000)[0][0]
    assert batch[1][1] == render_batch(tiny_tokenizer, [other], 1000)[1][0]


def test_prompt_ends_with_the_generation_header(tiny_tokenizer):
    ids = render_prompt(tiny_tokenizer, CONV[:1])
    assert tiny_tokenizer.decode(ids).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.bad_input
def test_a_template_that_is_not_prefix_stable_is_rejected(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    # puts the number of messages in the header: earlier renderings are not prefixes of later ones
    tok.chat_template = ("{{ messages|length }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError, match="chat template"):
        render_batch(tok, [CONV], 1000)


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_conversation_the_template_refuses_is_reported_not_fatal(tiny_tokenizer, tmp_path):
    import copy
    import json

    from data_prep.build import prepare_dataset
    from mtp_train.config import DataConfig

    tok = copy.deepcopy(tiny_tokenizer)
    # like Gemma's or Mistral's templates: no system turn allowed
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                         "{% endif %}")
    with_system = [{"role": "system", "content": "S"}, *CONV[:2]]
    ids, labels, errors = render_batch(tok, [with_system, CONV], 1000)
    assert "System role not supported" in errors[0] and ids[0] == [] and errors[1] == ""
    assert tok.decode([t for t in labels[1] if t != IGNORE]) == "yo!<|im_end|>4<|im_end|>"

    rows = [{"messages": with_system}] * 3 + [{"messages": CONV}] * 5
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare_dataset(DataConfig(name="j", source="jsonl", path=str(path), max_length=200,
                                   val_fraction=0.2, output_dir=str(tmp_path / "out")), tok)
    assert m["counts"]["dropped_after_render"] == {"chat template refused the conversation": 3}
    assert m["counts"]["kept"] == 5


@pytest.mark.bad_input
def test_a_huge_row_is_cut_before_it_is_tokenized_and_gives_the_same_tokens(tiny_tokenizer, monkeypatch):
    """One 2 MB message: the tokenizer sees at most 2 x max_length x (longest token) characters,
    and the row's ids and labels equal those of tokenizing the whole text, then truncating."""
    from mtp_train.data import template

    huge = "a lot of things, " * 120_000
    question = [{"role": "user", "content": "tell me " + huge}, {"role": "assistant", "content": "ok"}]
    answer = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "here: " + huge}]
    seen = []
    real = type(tiny_tokenizer).__call__

    def spy(self, texts, *a, **k):
        seen.extend(len(t) for t in texts)
        return real(self, texts, *a, **k)

    want = {}
    for name, conv in (("question", question), ("answer", answer)):
        full = tiny_tokenizer.apply_chat_template(conv, tokenize=False)
        assert len(full) > 2_000_000
        want[name] = list(tiny_tokenizer(full, add_special_tokens=False, truncation=True, max_length=64)["input_ids"])
    # the answer's labels as the whole text gives them (the route before texts were cut)
    full = tiny_tokenizer.apply_chat_template(answer, tokenize=False)
    enc = tiny_tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=64)
    spans = template.assistant_char_spans(tiny_tokenizer, answer, full, enc["offset_mapping"][-1][1])
    ref_labels = template.label_tokens(enc["offset_mapping"], enc["input_ids"], spans)
    monkeypatch.setattr(type(tiny_tokenizer), "__call__", spy)
    ids, labels, errors = render_batch(tiny_tokenizer, [question, answer], 64)
    assert ids == [want["question"], want["answer"]] and errors == ["", ""]
    assert all(v == IGNORE for v in labels[0])  # the answer lies past the 64 tokens
    assert labels[1] == ref_labels and any(v != IGNORE for v in labels[1])  # the huge answer starts inside
    assert max(seen) <= 2 * 64 * template.longest_token_chars(tiny_tokenizer)


@pytest.mark.bad_input
def test_eval_prompts_the_template_refuses_are_an_error_naming_the_line(tiny_tokenizer, tmp_path):
    import copy

    from mtp_train.evaluation.prompts import load_prompts_jsonl

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"messages": [{"role": "system", "content": "S"}, '
                    '{"role": "user", "content": "u"}]}\n')
    with pytest.raises(DataError, match=r"p.jsonl, line 2: the chat template refused these messages "
                                        r"\(System role not supported\)"):
        load_prompts_jsonl(path, tok)
