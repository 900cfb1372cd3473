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
    ids, labels = render_batch(tok, [CONV], max_length=1000)
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
    full_ids, full_labels = render_batch(tiny_tokenizer, [CONV], max_length=1000)
    cut = len(full_ids[0]) - 6  # inside the second answer's tail
    ids, labels = render_batch(tiny_tokenizer, [CONV], max_length=cut)
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


def test_a_template_that_is_not_prefix_stable_is_rejected(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    # puts the number of messages in the header: earlier renderings are not prefixes of later ones
    tok.chat_template = ("{{ messages|length }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError, match="chat template"):
        render_batch(tok, [CONV], 1000)
