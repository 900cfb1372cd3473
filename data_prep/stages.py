"""The stages of `mtp-prep` (mtp_train/cli/prep.py): backbone, data, distill, cache; each skips itself when
its manifest says it is up to date."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from mtp_train.config import Config
from mtp_train.data.prepared import (
    cache_compute,
    cache_location,
    check_labelled_is_current,
    labelled_data_config,
)
from mtp_train.errors import ConfigError
from mtp_train.layout import data_dirs, distilled_dir, labelled_dir, max_length, stage_lock

log = logging.getLogger(__name__)
STAGES = ("backbone", "data", "distill", "cache", "all")


def run_prep(cfg: Config) -> dict:
    """Run the requested stages; returns {stage: (seconds, summary)}."""
    if cfg.stage not in STAGES:
        raise ConfigError(f"stage: mtp-prep has no stage {cfg.stage!r}; choose one of {', '.join(STAGES)}")
    todo = STAGES[:3] if cfg.stage == "all" else (cfg.stage,)  # the cache is asked for by name
    from filelock import FileLock

    results = {}
    out = Path(cfg.data.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stage in todo:
        t0 = time.time()
        # sweep points started together (locally or on SLURM) may ask for the same preparation:
        # one builds it, the others wait and then find it done (every stage is resumable)
        with FileLock(str(out / stage_lock(stage))):
            summary = STAGE_FNS[stage](cfg)
        results[stage] = (time.time() - t0, summary)
        log.info("stage %s done in %.1f s", stage, results[stage][0])
    return results


def _stage_backbone(cfg: Config) -> dict:
    from mtp_train.backbone import convert_gguf

    if cfg.backbone.source == "tiny":
        return {"where": "built in code (backbone=tiny)"}
    if cfg.backbone.source == "gguf":
        return {"where": str(convert_gguf(cfg.backbone, force=cfg.force))}
    return {"where": cfg.backbone.path}


def _stage_data(cfg: Config) -> dict:
    from data_prep.build import prepare_dataset
    from mtp_train.backbone import load_tokenizer

    tok = load_tokenizer(cfg.backbone)
    m = prepare_dataset(labelled_data_config(cfg), tok,
                        keep_prompt_only=cfg.data.distill.enabled, force=cfg.force)
    c = m["counts"]
    return {"where": str(labelled_dir(cfg)),
            "rows": f"{c['complete_records']:,} complete conversations in the source, "
                    f"{c['usable']:,} usable, {c['sampled']:,} sampled, {c['kept']:,} kept "
                    f"(train {m['splits']['train']:,} / val {m['splits']['validation']:,})",
            "tokens": f"{m['assistant_tokens']['train']:,} assistant tokens of {m['tokens']['train']:,} (train)"}


def _stage_distill(cfg: Config) -> dict:
    if not cfg.data.distill.enabled:
        return {"where": "skipped (data.distill.enabled=false)"}
    from data_prep.distill import distill
    from mtp_train.backbone import load_backbone

    backbone = load_backbone(cfg.backbone)
    check_labelled_is_current(cfg, backbone.tokenizer)
    from mtp_train.pipeline.serving import backbone_for_serving

    m = distill(labelled_dir(cfg), distilled_dir(cfg), backbone, cfg.data.distill,
                cfg.data.max_length, force=cfg.force, backbone_dir=backbone_for_serving(cfg.backbone),
                stop_at=distill_stop_at(cfg))
    cut = m.get("stopped_at_budget")
    return {"where": str(distilled_dir(cfg)),
            "rows": f"train {m['splits']['train']:,} / val {m['splits']['validation']:,} "
                    f"({m['finished_with_eos']['train']:,} train answers ended with end-of-turn)"
                    + (f"; the budget stopped it at {cut['train_prompts']:,} of {cut['planned']:,} train prompts"
                       if cut else ""),
            "tokens": f"{m['answer_tokens']['train']:,} answer tokens (train)"}


def distill_stop_at(cfg: Config, now: float | None = None) -> float | None:
    """When distillation stops starting train shards: budget.distill_share of the time left to
    budget.deadline (None without a deadline or a share)."""
    b = cfg.budget
    if b.deadline is None or b.distill_share <= 0:
        return None
    from mtp_train.pipeline.budget import check_deadline

    now = time.time() if now is None else now
    check_deadline(b.deadline, now)
    return now + b.distill_share * max(0.0, b.deadline - now)


def _stage_cache(cfg: Config) -> dict:
    from data_prep.cache import build_cache, reusable_states
    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import load_splits
    from mtp_train.heads.persist import aux_layers_for

    backbone = load_backbone(cfg.backbone)
    key, out = cache_location(cfg, backbone)
    compute = cache_compute(cfg, backbone)
    m = build_cache(load_splits(data_dirs(cfg), vocab_size=backbone.vocab_size), backbone, out, key,
                    max_length(cfg), compute=compute,
                    known=reusable_states(data_dirs(cfg), backbone.identity, compute),
                    aux_layers=aux_layers_for(cfg.heads, backbone.config))
    reused = m.get("tokens_reused_this_run", 0)
    return {"where": str(out),
            "rows": f"{m['tokens']:,} tokens of train.data_use={cfg.train.data_use}, "
                    f"{m['bytes'] / 2**20:,.1f} MiB, {m['bytes_per_token']:,} bytes per token, "
                    f"computed in {compute}"
                    + (f"; {reused:,} tokens' states kept from distillation" if reused else "")}


STAGE_FNS = {"backbone": _stage_backbone, "data": _stage_data, "distill": _stage_distill,
             "cache": _stage_cache}


def print_summary(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mtp-prep")
    for col in ("stage", "seconds", "where", "what"):
        table.add_column(col, overflow="fold")
    for stage, (secs, s) in results.items():
        what = "\n".join(v for k, v in s.items() if k != "where")
        where = s["where"]
        if Path(where).exists():
            where = str(Path(where).resolve())
        table.add_row(stage, f"{secs:.1f}", where, what)
    Console().print(table)
