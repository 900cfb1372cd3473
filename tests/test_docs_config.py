"""docs/configuration.md stays true to the schema (mtp_train/config.py) and to the groups in conf/.

The doc's key tables are the Markdown tables whose header starts `| key | default | allowed | read
by |`; each row names one dotted key in backticks, its default in backticks as one types it in an
override (`null`, `true`, `[a, b]`, `???` for a value the group file must set), and the commands
that read it (prep, train, clp, eval; a parenthesis adds a remark).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from mtp_train import config_rules
from mtp_train.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
CONF = ROOT / "conf"


def schema_keys(cls: type = Config, prefix: str = "") -> dict[str, object]:
    """Every leaf key of the schema as a dotted name -> its default; a field whose default is a
    dataclass is a section and is walked, not listed."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if dataclasses.is_dataclass(default):
            out.update(schema_keys(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = default
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def doc_tables(text: str, first_column: str) -> list[list[str]]:
    """Rows (as cells) of every table whose first header cell is `first_column`."""
    rows, inside = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        cells = _cells(line)
        if cells[0] == first_column:
            inside = True
        elif inside and not set(line) <= set("|-: "):
            rows.append(cells)
    return rows


def _ticked(cell: str) -> str:
    m = re.fullmatch(r"`([^`]*)`", cell)
    assert m, f"expected one backticked value, got {cell!r}"
    return m.group(1)


def doc_rows(text: str) -> dict[str, list[str]]:
    """key -> its row's cells, from the key tables; a key listed twice fails."""
    out: dict[str, list[str]] = {}
    for cells in doc_tables(text, "key"):
        key = _ticked(cells[0])
        assert key not in out, f"docs/configuration.md lists {key} twice"
        out[key] = cells
    return out


def doc_keys(text: str) -> dict[str, str]:
    """key -> the default cell's text."""
    return {k: _ticked(cells[1]) for k, cells in doc_rows(text).items()}


def read_by(cell: str) -> set[str]:
    """The commands of a "read by" cell, its parenthesised remarks left out."""
    return {c.strip() for c in re.sub(r"\([^)]*\)", "", cell).split(",") if c.strip()}


def parse_default(text: str):
    """A default cell's value as YAML reads it (`???` stays the string OmegaConf uses for MISSING)."""
    if text == "???":
        return "???"
    value = yaml.safe_load(text)
    if isinstance(value, str):  # PyYAML reads 1e-05 as a string
        try:
            return float(value)
        except ValueError:
            return value
    return value


def same(written, expected) -> bool:
    """A parsed doc value equals the schema's: 1 and 1.0 alike, but never 0 and false or null."""
    if isinstance(expected, bool) or expected is None or isinstance(written, bool):
        return type(written) is type(expected) and written == expected
    if isinstance(expected, (int, float)) and isinstance(written, (int, float)):
        return float(written) == float(expected)
    if isinstance(expected, (list, tuple)) and isinstance(written, list):
        return len(written) == len(expected) and all(
            same(w, e) for w, e in zip(written, expected, strict=True))
    return written == expected


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def test_every_schema_key_is_documented_and_every_documented_key_exists(doc):
    schema, documented = schema_keys(), doc_keys(doc)
    missing = sorted(set(schema) - set(documented))
    stale = sorted(set(documented) - set(schema))
    assert not missing, f"docs/configuration.md lacks a row for {missing}"
    assert not stale, f"docs/configuration.md documents keys the schema does not have: {stale}"


def test_documented_defaults_are_the_schemas(doc):
    schema = schema_keys()
    wrong = {k: (v, schema[k]) for k, v in doc_keys(doc).items()
             if k in schema and not same(parse_default(v), schema[k])}
    assert not wrong, "docs/configuration.md: defaults that differ from mtp_train/config.py " + \
        ", ".join(f"{k}: doc `{d}`, schema {s!r}" for k, (d, s) in sorted(wrong.items()))


def test_read_by_is_what_each_command_reads(doc):
    """For every key a command's READS names, the doc's "read by" lists exactly those commands."""
    reads = config_rules.READS
    wrong = {}
    for key, cells in doc_rows(doc).items():
        wanted = {c for c, keys in reads.items() if any(key == r or key.startswith(r + ".") for r in keys)}
        if wanted and read_by(cells[3]) != wanted:
            wrong[key] = (cells[3], sorted(wanted))
    assert not wrong, "docs/configuration.md: read-by cells that differ from config_rules.READS " + \
        ", ".join(f"{k}: doc {d!r}, READS {w}" for k, (d, w) in sorted(wrong.items()))


def test_every_config_group_option_is_listed(doc):
    """Each conf/<group>/<option>.yaml is named in the group table's row for <group>."""
    groups = {_ticked(cells[0]): set(re.findall(r"`([^`]+)`", cells[1]))
              for cells in doc_tables(doc, "group")}
    missing = []
    for path in sorted(CONF.rglob("*.yaml")):
        if path.parent == CONF:
            continue  # config.yaml, the primary config
        group = path.parent.relative_to(CONF).as_posix()
        if path.stem not in groups.get(group, set()):
            missing.append(f"{group}={path.stem}")
    assert not missing, f"docs/configuration.md's group table lacks {missing}"


def test_trainer_values_are_the_group_files(doc):
    """The trainer table's values are conf/trainer/default.yaml's (a row may pair several keys with
    as many values)."""
    conf = yaml.safe_load((CONF / "trainer" / "default.yaml").read_text())
    rows = doc_tables(doc, "trainer key")
    assert rows, "docs/configuration.md has no trainer table"
    for cells in rows:
        keys, values = re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1])
        assert len(keys) == len(values), cells
        for key, value in zip(keys, values, strict=True):
            name = key.removeprefix("trainer.")
            assert name in conf, f"{key}: not in conf/trainer/default.yaml"
            assert same(parse_default(value), conf[name]), f"{key}: doc {value}, default.yaml {conf[name]!r}"


def test_the_checks_can_fail():
    """The parsers find a dropped row, an invented key and a changed default."""
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `heads.k` |"))
    assert "heads.k" not in doc_keys(text.replace(row + "\n", ""))
    assert "heads.nope" in doc_keys(text + "\n| key | default |\n|---|---|\n| `heads.nope` | `1` |\n")
    k = schema_keys()["heads.k"]
    assert same(parse_default(str(k)), k) and not same(parse_default(str(k + 1)), k)
    assert same(parse_default("[q_proj, v_proj]"), ["q_proj", "v_proj"])
    assert not same(parse_default("0"), False) and not same(parse_default("null"), 0)
