"""The prompts mtp-eval and mtp-clp decode: a JSONL file of prompts (rows read by the data stage's
row parsing, held to its rules), the held-out split of a prepared dataset, or the source's
conversations the dataset never sampled, each rendered with the chat template up to the answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from mtp_train.errors import DataError


def checked_messages(raw: list, where: str) -> list[dict]:
    """A prompt's messages with the roles the data stage knows (`sources.ROLE_MAP`, ShareGPT names
    included) and text content; anything else is refused naming the line and the message. Unlike
    the data stage, which drops such a row and counts it, a prompt file is refused: it is short and
    written by hand, and a silently missing prompt would change what the report measures."""
    from mtp_train.data.sources import ROLE_MAP, message_fields

    if not raw:
        raise DataError(f"{where}: empty messages list")
    out = []
    for i, m in enumerate(raw):
        role, content = message_fields(m)
        if role is None:
            raise DataError(f"{where}: message {i} has an unknown role "
                            f"{(m.get('role', m.get('from')) if isinstance(m, dict) else m)!r} "
                            f"(known: {', '.join(sorted(set(ROLE_MAP)))})")
        if content is None:
            raise DataError(f"{where}: message {i} has no text content")
        out.append({**{k: v for k, v in m.items() if k not in ("from", "value")}, "role": role,
                    "content": content})  # other keys (name, tool_calls) stay for the template
    user = next((m for m in out if m["role"] == "user"), None)
    if user is None:
        raise DataError(f"{where}: no user message (the data stage drops such rows too)")
    if not user["content"].strip():
        raise DataError(f"{where}: empty prompt")
    return out


def load_prompts_jsonl(path: Path, tokenizer) -> list[list[int]]:
    """Rows {"prompt": str} (or {"messages": [...]}, as `data=jsonl` reads them; a "response" is
    left out) rendered with the chat template."""
    from jinja2 import TemplateError

    from mtp_train.data.sources import regular_file, row_to_messages
    from mtp_train.data.template import render_prompt

    path = regular_file(path, "eval.prompts", "a JSONL file of prompts")
    out = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}, line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x}, the "
                                f"line's byte {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg})") from None
            messages, why = row_to_messages(row, answer=False)
            if messages is None:
                raise DataError(f"{where}: {why}")
            messages = checked_messages(messages, where)
            try:
                out.append(render_prompt(tokenizer, messages))
            except TemplateError as e:
                raise DataError(f"{where}: the chat template refused these messages ({e})") from None
    if not out:
        raise DataError(f"{path}: no prompts in the file")
    return out


def row_prompt(ids: list[int], labels: list[int]) -> list[int] | None:
    """A prepared row's tokens before its first labelled (assistant) token; None without one."""
    from mtp_train.depth_targets import IGNORE

    first = next((i for i, v in enumerate(labels) if v != IGNORE), None)
    return list(ids[:first]) if first else None


def held_out_prompts(data_dir: Path, split: str = "validation") -> list[list[int]]:
    """The prompts of a prepared data split (by default the held-out one): each row's tokens before
    its first labelled (assistant) token, i.e. the rendered conversation up to the generation prompt."""
    from mtp_train.data.prepared import load_prepared

    rows = load_prepared(data_dir, "run `mtp-prep` or set eval.prompts")[split]
    out = [p for p in map(row_prompt, rows["input_ids"], rows["labels"]) if p]
    if not out:
        raise DataError(f"{data_dir}: the {split} split has no prompt")
    return out


def dataset_ids(data_dir: Path) -> set[str]:
    """The conversation ids of a prepared dataset, over all of its splits."""
    from mtp_train.data.prepared import load_prepared

    ds = load_prepared(data_dir, "run `mtp-prep stage=data` first")
    return {str(i) for split in ds for i in ds[split]["id"]}


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """The messages before the first assistant turn, or None when no user turn comes before it."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    head = messages[:first]
    return head if any(m["role"] == "user" for m in head) else None


def unseen_conversations(conversations: list[dict], seen: set[str], seed: int) -> list[dict]:
    """The conversations whose id is not in `seen`, in an order shuffled by `seed`."""
    out = [c for c in conversations if str(c["id"]) not in seen]
    random.Random(seed).shuffle(out)
    return out


def typical_prompt(prompts: list[list[int]]) -> list[int]:
    """The prompt of median length: the one the deadline's decoding-rate probes price decodes on."""
    return sorted(prompts, key=len)[len(prompts) // 2]


def render_prompts(conversations, tokenizer) -> Iterator[list[int]]:
    """Each conversation rendered up to its first assistant turn (lazily: callers stop early)."""
    from mtp_train.data.template import render_prompt

    for conv in conversations:
        messages = prompt_messages(conv["messages"])
        if messages is not None:
            yield render_prompt(tokenizer, messages)
