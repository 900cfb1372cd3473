"""Conversation sources: ShareGPT salvage from a truncated file, JSONL bad rows, filters."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mtp_train.data import sources
from mtp_train.errors import DataError


def _record(i, turns):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD = [
    _record(0, [("human", "Hi"), ("gpt", "Hello!")]),
    _record(1, [("system", "Be brief."), ("human", "2+2?"), ("gpt", "4"), ("human", "3+3?"), ("gpt", "6")]),
    _record(2, [("gpt", "leading answer"), ("human", "Why?"), ("gpt", "Because.")]),
    _record(3, [("human", ""), ("gpt", "answer to nothing")]),  # empty prompt
    _record(4, [("human", "only a question")]),  # no assistant turn
    _record(5, []),  # no user turn
    _record(6, [("human", "Q"), ("gpt", "A"), ("human", "follow-up"), ("gpt", "")]),  # empty last turn
]


def _write_truncated_array(path, records, cut_last_at=40):
    """A pretty-printed JSON array whose last record is cut mid-way, like the bundled ShareGPT file."""
    body = json.dumps(records, indent=2)
    last = json.dumps(_record(99, [("human", "this record is cut off"), ("gpt", "never finished")]), indent=2)
    text = body[:-2] + ",\n" + "\n".join("  " + ln for ln in last.splitlines())[:cut_last_at]
    path.write_text(text)
    return path


@pytest.mark.bad_input
def test_sharegpt_salvage_keeps_complete_records_and_counts_the_cut_one(tmp_path):
    path = _write_truncated_array(tmp_path / "sg.json", GOOD)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())  # the file really is broken
    stats = sources.SourceStats()
    convs = list(sources.read_sharegpt(path, stats, keep_prompt_only=False))
    assert stats.parsed == len(GOOD)
    assert stats.dropped["truncated record at end of file"] == 1
    assert stats.dropped["empty prompt"] == 1
    assert stats.dropped["no assistant turn"] == 1
    assert stats.dropped["no user turn"] == 1
    assert [c["id"] for c in convs] == ["c0", "c1", "c2", "c6"]
    assert convs[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in convs[2]["messages"]] == ["user", "assistant"]  # leading answer dropped
    assert [m["content"] for m in convs[3]["messages"]] == ["Q", "A"]  # cut before the empty turn


def test_sharegpt_prompt_only_rows_are_kept_for_self_distillation(tmp_path):
    path = _write_truncated_array(tmp_path / "sg.json", GOOD)
    stats = sources.SourceStats()
    ids = [c["id"] for c in sources.read_sharegpt(path, stats, keep_prompt_only=True)]
    assert "c4" in ids and "no assistant turn" not in stats.dropped


@pytest.mark.bad_input
def test_sharegpt_malformed_middle_record_is_skipped_with_its_line(tmp_path):
    good = json.dumps(GOOD[:2], indent=2)
    broken = good.replace('"value": "Hello!"', '"value": "Hello!" "oops": 1', 1)
    path = tmp_path / "sg.json"
    path.write_text(broken)
    stats = sources.SourceStats()
    convs = list(sources.read_sharegpt(path, stats, keep_prompt_only=False))
    assert [c["id"] for c in convs] == ["c1"]
    assert stats.dropped["malformed JSON record"] == 1
    assert stats.bad_lines == [2]  # the record opens on line 2


@pytest.mark.bad_input
def test_sharegpt_file_with_nothing_parseable_is_an_error_naming_it(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"id": "x", "conversations": [')
    with pytest.raises(DataError, match="broken.json"):
        list(sources.read_sharegpt(path, sources.SourceStats(), False))
    path.write_text("{}")
    with pytest.raises(DataError, match="not a JSON array"):
        list(sources.read_sharegpt(path, sources.SourceStats(), False))


@pytest.mark.bad_input
def test_jsonl_bad_rows_are_skipped_counted_and_warned(tmp_path, caplog):
    from data_prep.build import _report_source
    from mtp_train.config import DataConfig

    lines = [
        json.dumps({"prompt": "What is 1+1?", "response": "2"}),
        '{"prompt": "truncated',
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]}),
        "",
        "not json at all",
        json.dumps({"text": "no known field"}),
        json.dumps({"prompt": "   ", "response": "x"}),
        json.dumps({"prompt": "prompt without answer"}),
        json.dumps({"prompt": 5, "response": None}),
        json.dumps({"messages": "not a list"}),
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
    ]
    path = tmp_path / "user.jsonl"
    path.write_text("\n".join(lines) + "\n")
    stats = sources.SourceStats()
    convs = list(sources.read_jsonl(path, stats, keep_prompt_only=False))
    assert [c["messages"][-1]["content"] for c in convs] == ["2", "hey"]
    assert stats.dropped["malformed JSON line"] == 2
    assert stats.bad_lines == [2, 5, 6, 7, 8]  # the first dropped rows, whatever the reason
    # hostile round 4: rows dropped by the message rules had no line number
    assert stats.lines["empty prompt"] == [7] and stats.lines["no assistant turn"] == [8]
    assert stats.lines["unknown role or non-text content"] == [11]
    assert stats.dropped['row without "prompt" or "messages"'] == 1
    assert stats.dropped['"prompt" is not text'] == 1 and stats.dropped['"messages" is not a list of turns'] == 1
    assert stats.dropped["empty prompt"] == 1
    assert stats.dropped["no assistant turn"] == 1
    with caplog.at_level(logging.INFO):
        _report_source(DataConfig(name="j", source="jsonl", path=str(path), output_dir="x"), stats, 2)
    assert "skipped 2 unparseable record(s): 2 malformed JSON line (first at line(s) 2, 5)" in caplog.text
    assert 'dropped 1: row without "prompt" or "messages" (first at line(s) 6)' in caplog.text  # its own lines


@pytest.mark.bad_input
def test_jsonl_where_nothing_parses_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "garbage.jsonl"
    path.write_text("nope\n{broken\n")
    with pytest.raises(DataError, match="garbage.jsonl"):
        list(sources.read_jsonl(path, sources.SourceStats(), False))
    with pytest.raises(DataError, match="does not exist"):
        list(sources.read_jsonl(tmp_path / "missing.jsonl", sources.SourceStats(), False))
    with pytest.raises(DataError, match=r"data.path: .* is a directory; expected one JSONL file"):
        list(sources.read_jsonl(tmp_path, sources.SourceStats(), False))


@pytest.mark.bad_input
def test_a_fifo_or_a_device_as_data_path_is_named_for_what_it_is(tmp_path):
    """/dev/zero would be read forever and a FIFO would block: each is refused in one line saying what
    it is, not that it "does not exist"; the same for eval.prompts and the disk source."""
    import os

    from mtp_train.evaluation.prompts import load_prompts_jsonl

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        for read in (sources.read_jsonl, sources.read_sharegpt, sources.read_disk):
            with pytest.raises(DataError, match=rf"data.path: {path} is {kind}( \(named pipe\))?, not a regular file"):
                list(read(path, sources.SourceStats(), False))
        with pytest.raises(DataError, match=rf"eval.prompts: {path} is {kind}"):
            load_prompts_jsonl(path, None)
    (tmp_path / "x.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match=r"data.path: .* is a file; data.source=disk reads a directory"):
        list(sources.read_disk(tmp_path / "x.jsonl", sources.SourceStats(), False))


@pytest.mark.bad_input
def test_an_answer_that_is_not_text_drops_the_row_instead_of_keeping_its_prompt(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "What is 1 plus 1?", "response": 2}, {"prompt": "Name a colour.", "completion": ["red"]},
        {"prompt": "Say hi.", "response": "hi"}]) + "\n")
    stats = sources.SourceStats()
    convs = list(sources.read_jsonl(path, stats, keep_prompt_only=True))
    assert [c["messages"][-1]["content"] for c in convs] == ["hi"]
    assert stats.dropped['"response"/"completion" is not text'] == 2 and stats.bad_lines == [1, 2]


def test_disk_dataset_source(tmp_path):
    from datasets import Dataset

    Dataset.from_list([
        {"prompt": "a?", "response": "b"}, {"prompt": "", "response": "c"},
    ]).save_to_disk(str(tmp_path / "ds"))
    stats = sources.SourceStats()
    convs = list(sources.read_disk(tmp_path / "ds", stats, False))
    assert len(convs) == 1 and stats.dropped["empty prompt"] == 1
    Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match="needs a 'messages'"):
        list(sources.read_disk(tmp_path / "bad", sources.SourceStats(), False))


def test_tiny_conversations_are_deterministic():
    a = sources.make_tiny_conversations(20, seed=1)
    assert a == sources.make_tiny_conversations(20, seed=1)
    assert a != sources.make_tiny_conversations(20, seed=2)
    assert all(c["messages"][-1]["role"] == "assistant" for c in a)


@pytest.mark.bad_input
def test_rows_with_bytes_that_are_not_utf8_are_dropped_by_line_not_kept_with_replacement_chars(tmp_path, caplog):
    """Both file readers: the row with the bad byte is skipped, counted and its line reported;
    no U+FFFD reaches the prepared text, and the rows around it are kept."""
    from data_prep.build import _report_source
    from mtp_train.config import DataConfig

    jsonl = tmp_path / "u.jsonl"
    jsonl.write_bytes(b'{"prompt": "ok", "response": "fine"}\n{"prompt": "caf\xe9", "response": "x"}\n'
                      b'{"prompt": "also ok", "response": "good"}\n')
    stats = sources.SourceStats()
    convs = list(sources.read_jsonl(jsonl, stats, keep_prompt_only=False))
    assert [c["messages"][0]["content"] for c in convs] == ["ok", "also ok"]
    assert stats.dropped[sources.NOT_UTF8_REASON] == 1 and stats.bad_lines == [2]
    with caplog.at_level(logging.WARNING):
        _report_source(DataConfig(name="j", source="jsonl", path=str(jsonl), output_dir="x"), stats, 2)
    assert "1 bytes that are not UTF-8" in caplog.text and "line(s) 2" in caplog.text
    # a whole file in Latin-1 is named as an encoding problem, not as "no JSON object" (hostile round 3)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "café", "response": "déjà vu"}\n{"prompt": "naïve", "response": "x"}\n'
                      .encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.jsonl: not UTF-8: 2 line\(s\) hold bytes that are not UTF-8 "
                                        r"\(first at line 1\).*iconv -f latin1 -t utf-8"):
        list(sources.read_jsonl(latin, sources.SourceStats(), keep_prompt_only=False))

    array = tmp_path / "sg.json"
    array.write_bytes(json.dumps(GOOD[:2], indent=2).replace('"Hello!"', '"Hello\\u0021 @"').encode()
                      .replace(b"@", b"\xff\xfe"))
    stats = sources.SourceStats()
    convs = list(sources.read_sharegpt(array, stats, keep_prompt_only=False))
    assert [c["id"] for c in convs] == ["c1"] and stats.parsed == 1
    assert stats.dropped[sources.NOT_UTF8_REASON] == 1 and stats.bad_lines == [2]
    assert not any("\ufffd" in m["content"] for c in convs for m in c["messages"])


@pytest.mark.bad_input
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_prepared_dataset_is_refused_in_one_line_naming_it(tmp_path, damage):
    """A truncated or deleted .arrow file of a prepared dataset: one line naming the directory,
    not a pyarrow or IndexError traceback at some later row."""
    from datasets import Dataset, DatasetDict

    from mtp_train.data.prepared import load_prepared
    from mtp_train.layout import MANIFEST

    rows = {"input_ids": [list(range(i, i + 50)) for i in range(400)], "labels": [[1] * 50] * 400}
    DatasetDict({"train": Dataset.from_dict(rows), "validation": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "d"))
    (tmp_path / "d" / MANIFEST).write_text("{}")
    assert len(load_prepared(tmp_path / "d")["train"]) == 400
    (arrow,) = (tmp_path / "d" / "train").glob("*.arrow")
    if damage == "truncate":
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    else:
        arrow.unlink()
    with pytest.raises(DataError, match=r"/d: the prepared dataset cannot be read \(.*\); it is damaged"):
        load_prepared(tmp_path / "d")


@pytest.mark.bad_input
@pytest.mark.parametrize("damage, message", [
    ("label", r"/d/train: row 1, position 2: label 4294967196 is neither -100 nor the token there \(2\)"),
    ("length", r"/d/train: row 0 has 4 input_ids and 3 labels"),
    ("vocab", r"/d/validation: row 0, position 1: token id 100000 is outside the backbone's vocabulary \[0, 259\)"),
])
def test_rows_that_would_train_on_wrong_targets_are_refused(tmp_path, damage, message):
    """A damaged label turns a prompt token into a target, an id past the vocabulary breaks the
    embedding: load_splits refuses both, naming the directory, split, row and position."""
    from datasets import Dataset, DatasetDict

    from mtp_train.data.prepared import load_splits
    from mtp_train.layout import MANIFEST

    train = {"input_ids": [[1, 2, 3, 4], [5, 6, 2, 8]], "labels": [[-100, -100, 3, 4], [-100, -100, 2, 8]]}
    val = {"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}
    if damage == "label":
        train["labels"][1][2] = 4294967196
    elif damage == "length":
        train["labels"][0] = train["labels"][0][:3]
    else:
        val["input_ids"][0][1] = val["labels"][0][1] = 100000
    DatasetDict({"train": Dataset.from_dict(train), "validation": Dataset.from_dict(val)}).save_to_disk(str(tmp_path / "d"))
    (tmp_path / "d" / MANIFEST).write_text("{}")
    with pytest.raises(DataError, match=message):
        load_splits([tmp_path / "d"], vocab_size=259)


def test_a_jsonl_file_starting_with_a_byte_order_mark_keeps_its_first_row(tmp_path):
    """A BOM (as some editors save UTF-8) made the first valid row "malformed" (hostile round 5)."""
    rows = [{"prompt": "What is 1+1?", "response": "2"}, {"prompt": "And 2+2?", "response": "4"}]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode() + b"\n")
    stats = sources.SourceStats()
    convs = list(sources.read_jsonl(path, stats, keep_prompt_only=False))
    assert [c["messages"][-1]["content"] for c in convs] == ["2", "4"] and not stats.bad_lines


@pytest.mark.bad_input
def test_too_few_usable_conversations_say_why_and_name_the_length(typed_cfg, tmp_path):
    """Prompts that alone fill data.max_length left "only 0 usable conversation(s)" with the reason
    counted but never shown (hostile round 5)."""
    import dataclasses

    from data_prep.stages import run_prep

    rows = [{"prompt": " ".join(["word"] * 300) + f" {i}?", "response": "yes"} for i in range(6)]
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = typed_cfg("debug=smoke", "data=jsonl", "data.name=long", f"data.path={path}", "data.max_length=64")
    with pytest.raises(DataError, match=r"only 0 usable conversation\(s\); need 2 or more \(6 dropped: no assistant "
                                        r"token within data\.max_length\) \(their prompts fill data\.max_length=64"):
        run_prep(dataclasses.replace(cfg, stage="data"))
