"""Chat templating with assistant-only labels.

A conversation is rendered with the backbone's own chat template. The tokens of each assistant turn
(its content and the end-of-turn token, not the template's header or the newline after it) keep
their id as label; every other position is IGNORE, so heads learn only what the model says.

How the assistant spans are found, for any template: render the conversation up to turn i with the
generation prompt (where the answer starts) and up to and including turn i (where it ends), and
require both to be prefixes of the full rendering. Character spans then map to tokens through the
fast tokenizer's offsets, on one tokenisation of the whole text (no boundary effects).
"""

from __future__ import annotations

import weakref

from mtp_train.choices import IGNORE_INDEX
from mtp_train.errors import DataError

IGNORE = IGNORE_INDEX


def assistant_char_spans(tokenizer, messages: list[dict], text: str,
                         limit: int | None = None) -> list[tuple[int, int]]:
    """The [start, end) character span in `text` (the full rendering) of every assistant turn.

    Turns that start at or after character `limit` (where truncation cuts the text) are not
    rendered at all: long conversations would otherwise cost one prefix rendering per turn.
    """
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if limit is not None and len(before) >= limit:
            break
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(upto)):
            raise DataError(
                "the tokenizer's chat template renders a conversation differently from its own "
                "prefixes, so assistant turns cannot be located; give a template that appends turns")
        spans.append((len(before), len(upto.rstrip())))  # rstrip: the newline after end-of-turn
    return spans


def label_tokens(offsets: list[tuple[int, int]], ids: list[int], spans: list[tuple[int, int]]):
    """Labels for one tokenised text: the id where the token starts inside a span, else IGNORE."""
    labels = [IGNORE] * len(ids)
    si = 0
    for t, (start, end) in enumerate(offsets):
        if end <= start:  # tokens with no characters (some BOS tokens)
            continue
        while si < len(spans) and start >= spans[si][1]:
            si += 1
        if si < len(spans) and spans[si][0] <= start < spans[si][1]:
            labels[t] = ids[t]
    return labels


_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (vocabulary strings, byte-level
    markers included, bound it from above)."""
    if tokenizer not in _LONGEST:
        _LONGEST[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return _LONGEST[tokenizer]


def render_batch(tokenizer, conversations: list[list[dict]], max_length: int):
    """Render and label a batch; returns input_ids, labels (truncated to max_length) and errors.

    A conversation the chat template refuses (some templates raise on a system turn or on two
    turns of the same role) gets empty ids and its error message, so the caller can drop and
    count it instead of losing the whole batch.
    """
    from jinja2 import TemplateError

    texts, errors = [], []
    for msgs in conversations:
        try:
            texts.append(tokenizer.apply_chat_template(msgs, tokenize=False))
            errors.append("")
        except TemplateError as e:
            texts.append("")
            errors.append(f"chat template refused the conversation: {e}")
    # the first max_length tokens cover at most max_length x (longest token) characters: cut the
    # text (with a 2x margin) before tokenizing, so one huge row does not tokenize in full to be cut
    budget = 2 * max_length * longest_token_chars(tokenizer)
    enc = tokenizer([t[:budget] for t in texts], add_special_tokens=False, return_offsets_mapping=True,
                    truncation=True, max_length=max_length)
    input_ids, labels = [], []
    for msgs, text, ids, offsets, err in zip(conversations, texts, enc["input_ids"],
                                             enc["offset_mapping"], errors, strict=True):
        if err:
            input_ids.append([])
            labels.append([])
            continue
        limit = offsets[-1][1] if offsets else 0  # truncation ends the text here
        try:
            spans = assistant_char_spans(tokenizer, msgs, text, limit)
        except TemplateError as e:
            input_ids.append([])
            labels.append([])
            errors[len(input_ids) - 1] = f"chat template refused the conversation: {e}"
            continue
        input_ids.append(list(ids))
        labels.append(label_tokens(offsets, ids, spans))
    return input_ids, labels, errors


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a prompt (messages before the answer) followed by the generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
