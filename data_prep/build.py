"""The data stage: a source's conversations -> labelled token rows -> train/validation Arrow dataset.

Output: `data.output_dir/` holding an HF `datasets` DatasetDict (train, validation) with columns
`id`, `messages`, `input_ids`, `labels` (assistant tokens only, see template.py), `num_tokens`,
`num_assistant_tokens`, `has_answer`, and a `manifest.json` with the source, kept/dropped counts,
tokenizer, max length, seed and the hash of all of these (a changed input rebuilds the stage).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from pathlib import Path

from mtp_train.artifacts import (
    is_up_to_date,
    publish_dir,
    read_manifest,
    temp_dir_for,
    write_json_atomic,
)
from mtp_train.choices import IGNORE_INDEX
from mtp_train.config import DataConfig
from mtp_train.data import sources
from mtp_train.data.sources import (
    data_stage_hash,
    read_conversations,
    source_identity,
    tokenizer_identity,
)
from mtp_train.data.template import render_batch
from mtp_train.errors import DataError
from mtp_train.layout import MANIFEST

log = logging.getLogger(__name__)


def prepare_dataset(cfg: DataConfig, tokenizer, keep_prompt_only: bool = False,
                    force: bool = False) -> dict:
    """Build (or reuse) the labelled dataset; returns its manifest."""
    out = Path(cfg.output_dir)
    wanted = data_stage_hash(cfg, tokenizer, keep_prompt_only)
    if not force and is_up_to_date(out, wanted):
        log.info("data: %s is up to date, skipping (force=true rebuilds)", out)
        return read_manifest(out)
    t0 = time.time()
    stats = sources.SourceStats()
    convs = read_conversations(cfg, stats, keep_prompt_only)
    _report_source(cfg, stats, len(convs))
    if not convs:
        raise DataError(f"data ({cfg.source}): nothing left after filtering; dropped {dict(stats.dropped)}")

    n_complete = sampled = len(convs)
    if cfg.max_conversations is not None and len(convs) > cfg.max_conversations:
        idx = sorted(random.Random(cfg.seed).sample(range(len(convs)), cfg.max_conversations))
        convs = [convs[i] for i in idx]
        sampled = len(convs)
        log.info("data: sampled %d of them (data.max_conversations, seed %d)", sampled, cfg.seed)

    from datasets import Dataset

    ds = Dataset.from_list(convs)

    def render(batch):
        ids, labels, errors = render_batch(tokenizer, batch["messages"], cfg.max_length)
        n_ans = [sum(lab != IGNORE_INDEX for lab in row) for row in labels]
        has_answer = [any(m["role"] == "assistant" for m in msgs) for msgs in batch["messages"]]
        return {"input_ids": ids, "labels": labels, "num_tokens": [len(r) for r in ids],
                "num_assistant_tokens": n_ans, "has_answer": has_answer, "render_error": errors}

    ds = ds.map(render, batched=True, batch_size=128, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                desc="render + tokenize")
    truncated_away = Counter(e.split(":")[0] for e in ds["render_error"] if e)
    if truncated_away:
        first = next(e for e in ds["render_error"] if e)
        log.warning("data (%s): the chat template refused %d conversation(s), dropped; first: %s",
                    cfg.source, sum(truncated_away.values()), first[:300])
    ds = ds.filter(lambda r: not r["render_error"], desc="filter")
    n_before = len(ds)
    ds = ds.filter(lambda r: (r["num_assistant_tokens"] > 0) or not r["has_answer"], desc="filter")
    truncated_away["no assistant token within data.max_length"] = n_before - len(ds)
    ds = ds.remove_columns("render_error")
    if len(ds) < 2:
        why = "; ".join(f"{n} dropped: {r}" for r, n in truncated_away.most_common() if n)
        hint = (f" (their prompts fill data.max_length={cfg.max_length}: raise it)"
                if truncated_away["no assistant token within data.max_length"] else "")
        raise DataError(f"data ({cfg.source}): only {len(ds)} usable conversation(s); need 2 or more"
                        f"{f' ({why}){hint}' if why else ''}")

    n_val = min(len(ds) - 1, max(cfg.min_val_rows, round(cfg.val_fraction * len(ds))))
    split = ds.train_test_split(test_size=n_val, seed=cfg.seed, shuffle=True)
    split["validation"] = split.pop("test")

    manifest = {
        "stage": "data",
        "config_hash": wanted,
        "source": source_identity(cfg),
        "counts": {
            "complete_records": stats.parsed,
            "usable": n_complete,
            "dropped_at_source": dict(stats.dropped),
            "bad_lines": stats.bad_lines,
            "sampled": sampled,
            "dropped_after_render": {k: v for k, v in truncated_away.items() if v},
            "kept": len(ds),
            "prompt_only": int(sum(1 for h in ds["has_answer"] if not h)),
        },
        "splits": {s: len(split[s]) for s in split},
        "tokens": {s: int(sum(split[s]["num_tokens"])) for s in split},
        "assistant_tokens": {s: int(sum(split[s]["num_assistant_tokens"])) for s in split},
        "tokenizer": tokenizer_identity(tokenizer),
        "max_length": cfg.max_length,
        "seed": cfg.seed,
        "elapsed_s": round(time.time() - t0, 1),
    }
    tmp = temp_dir_for(out)
    split.save_to_disk(str(tmp))
    write_json_atomic(tmp / MANIFEST, manifest)
    publish_dir(tmp, out)
    return manifest


def _at(stats: sources.SourceStats, reason: str) -> str:
    lines = stats.lines.get(reason)
    return f" (first at line(s) {', '.join(map(str, lines))})" if lines else ""


def _report_source(cfg: DataConfig, stats: sources.SourceStats, kept: int) -> None:
    where = cfg.path or ("the in-code generator" if cfg.source == "tiny" else "the bundled file")
    unparsed = {r: n for r, n in stats.dropped.items()
                if "malformed" in r or "truncated" in r or r == sources.NOT_UTF8_REASON}
    filtered = {r: n for r, n in stats.dropped.items() if r not in unparsed}
    log.info("data (%s): %s complete conversations kept from %s", cfg.source, f"{stats.parsed:,}", where)
    if unparsed:  # each reason with its own lines (a count beside other reasons' lines misleads)
        log.warning("data (%s): skipped %d unparseable record(s): %s", cfg.source, sum(unparsed.values()),
                    "; ".join(f"{n} {r}{_at(stats, r)}" for r, n in unparsed.items()))
    for reason, n in sorted(filtered.items(), key=lambda kv: -kv[1]):
        log.info("data (%s): dropped %s: %s%s", cfg.source, f"{n:,}", reason, _at(stats, reason))
    log.info("data (%s): %s conversations usable", cfg.source, f"{kept:,}")
