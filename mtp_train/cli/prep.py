"""mtp-prep: prepare the backbone and the data that heads train on.

Stages (each skips itself when its manifest says it is up to date; `force=true` redoes it):
  backbone  locate the backbone; a GGUF one is converted once to safetensors under paths.cache_dir
  data      conversations -> chat template -> assistant-only labels -> train/validation Arrow dataset
  distill   the backbone regenerates the answers (resumable: a killed run continues from its shards)
  cache     the backbone's hidden states for the rows mtp-train reads (train.data_use), which
            mtp-train then uses instead of running the backbone (asked for by name, not in `all`)
  all       backbone, data, distill in order

  mtp-prep                                        # the demo: SmolLM2 + ShareGPT, all stages
  mtp-prep stage=data data=sharegpt data.max_conversations=null
  mtp-prep stage=all data=jsonl data.path=my_prompts.jsonl backbone=hf backbone.path=/models/llama
  mtp-prep backbone=tiny                          # seconds, no preparation needed (smoke runs)
"""

from __future__ import annotations

import time
from pathlib import Path

import hydra

from mtp_train.cli.common import CONF_DIR, entry, log
from mtp_train.config import Config
from mtp_train.errors import ConfigError

STAGES = ("backbone", "data", "distill", "cache", "all")


def data_dirs(cfg: Config) -> list[Path]:
    """The prepared datasets mtp-train reads, by train.data_use."""
    return {"labelled": [labelled_dir(cfg)], "distilled": [distilled_dir(cfg)],
            "mix": [labelled_dir(cfg), distilled_dir(cfg)]}[cfg.train.data_use]


def cache_compute(cfg: Config, backbone) -> str:
    """The dtype the cache runs the backbone in: distillation's (data.distill.autocast)."""
    from mtp_train.data.distill import resolve_autocast

    return resolve_autocast(backbone.device, cfg.data.distill.autocast)


def cache_location(cfg: Config, backbone) -> tuple[str, Path]:
    from mtp_train.data.cache import STATES_DTYPE, cache_key, cache_path

    max_length = cfg.train.max_length or cfg.data.max_length
    key = cache_key(data_dirs(cfg), backbone.identity, max_length, STATES_DTYPE, cache_compute(cfg, backbone))
    return key, cache_path(Path(cfg.data.output_dir), key)


def labelled_dir(cfg: Config) -> Path:
    return Path(cfg.data.output_dir) / "labelled"


def distilled_dir(cfg: Config) -> Path:
    return Path(cfg.data.output_dir) / "distilled"


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
        with FileLock(str(out / f".{stage}.lock")):
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
    from mtp_train.backbone import load_tokenizer
    from mtp_train.data.build import prepare_dataset

    tok = load_tokenizer(cfg.backbone)
    m = prepare_dataset(_with_output(cfg.data, labelled_dir(cfg)), tok,
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
    from mtp_train.backbone import load_backbone
    from mtp_train.data.distill import distill

    backbone = load_backbone(cfg.backbone)
    _check_labelled_is_current(cfg, backbone.tokenizer)
    m = distill(labelled_dir(cfg), distilled_dir(cfg), backbone, cfg.data.distill,
                cfg.data.max_length, force=cfg.force)
    return {"where": str(distilled_dir(cfg)),
            "rows": f"train {m['splits']['train']:,} / val {m['splits']['validation']:,} "
                    f"({m['finished_with_eos']['train']:,} train answers ended with end-of-turn)",
            "tokens": f"{m['answer_tokens']['train']:,} answer tokens (train)"}


def _check_labelled_is_current(cfg: Config, tokenizer) -> None:
    from mtp_train.artifacts import read_manifest
    from mtp_train.data.build import data_stage_hash
    from mtp_train.errors import DataError

    m = read_manifest(labelled_dir(cfg))
    wanted = data_stage_hash(_with_output(cfg.data, labelled_dir(cfg)), tokenizer,
                             cfg.data.distill.enabled)
    if m is None or m.get("config_hash") != wanted:
        raise DataError(f"{labelled_dir(cfg)} is missing or was built with other data settings; "
                        "run `mtp-prep stage=data` (or stage=all) with the same overrides first")


def check_prepared_is_current(cfg: Config, tokenizer) -> None:
    """The datasets mtp-train reads were prepared from this config's data settings: the labelled
    dataset's hash matches them and the distilled one was made from that labelled dataset."""
    from mtp_train.artifacts import read_manifest
    from mtp_train.errors import DataError

    _check_labelled_is_current(cfg, tokenizer)
    if distilled_dir(cfg) in data_dirs(cfg):
        m, source = read_manifest(distilled_dir(cfg)), read_manifest(labelled_dir(cfg))
        if m is None or m.get("source_hash") != source.get("config_hash"):
            raise DataError(f"{distilled_dir(cfg)} is missing or was distilled from other data than "
                            f"{labelled_dir(cfg)}; run `mtp-prep stage=all` with the same overrides first")


def _stage_cache(cfg: Config) -> dict:
    from mtp_train.backbone import load_backbone
    from mtp_train.data.cache import build_cache, reusable_states
    from mtp_train.lit.data import load_splits

    backbone = load_backbone(cfg.backbone)
    key, out = cache_location(cfg, backbone)
    compute = cache_compute(cfg, backbone)
    m = build_cache(load_splits(data_dirs(cfg)), backbone, out, key,
                    cfg.train.max_length or cfg.data.max_length, compute=compute,
                    known=reusable_states(data_dirs(cfg), backbone.identity, compute))
    reused = m.get("tokens_reused_this_run", 0)
    return {"where": str(out),
            "rows": f"{m['tokens']:,} tokens of train.data_use={cfg.train.data_use}, "
                    f"{m['bytes'] / 2**20:,.1f} MiB, {m['bytes_per_token']:,} bytes per token, "
                    f"computed in {compute}"
                    + (f"; {reused:,} tokens' states kept from distillation" if reused else "")}


STAGE_FNS = {"backbone": _stage_backbone, "data": _stage_data, "distill": _stage_distill,
             "cache": _stage_cache}


def _with_output(data_cfg, out: Path):
    import dataclasses

    return dataclasses.replace(data_cfg, output_dir=str(out))


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


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def main(cfg, typed: Config):
    results = run_prep(typed)
    print_summary(results)
    return None


if __name__ == "__main__":
    main()
