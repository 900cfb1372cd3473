"""The prepared data (`mtp-prep` writes it) as the commands read it: its rows, whether it was made
from this config's data settings, and where the hidden-state cache for these inputs is."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from mtp_train import layout
from mtp_train.artifacts import read_manifest
from mtp_train.config import Config
from mtp_train.errors import DataError
from mtp_train.layout import MANIFEST

log = logging.getLogger(__name__)
COLUMNS = ["input_ids", "labels"]


def load_prepared(d: Path, next_step: str = "run `mtp-prep` first"):
    """A prepared dataset (a DatasetDict saved by a stage of mtp-prep), refused in one line naming the
    directory when it is missing or its files are damaged (a truncated .arrow, a deleted split)."""
    from datasets import load_from_disk

    if not (Path(d) / MANIFEST).is_file():
        raise DataError(f"{d}: no prepared dataset here; {next_step}")
    try:
        ds = load_from_disk(str(d))
        for split in ds:  # reading the first and last rows reaches the end of every file
            if len(ds[split]):
                ds[split][0], ds[split][len(ds[split]) - 1]
    except Exception as e:  # datasets / pyarrow report damage as many error types
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"{d}: the prepared dataset cannot be read ({type(e).__name__}: {first}); it is "
                        "damaged: delete it and rerun the mtp-prep stage that wrote it") from None
    return ds


def load_splits(dirs: list[Path], sizes: list[dict] | None = None):
    """Concatenate the train and validation splits of the prepared datasets in `dirs`; `sizes`, when
    given, receives each dataset's {split: rows} in order."""
    from datasets import concatenate_datasets

    parts = {"train": [], "validation": []}
    for d in dirs:
        ds = load_prepared(d, "run `mtp-prep` with the same backbone= and data= first")
        for s in parts:
            parts[s].append(ds[s].select_columns(COLUMNS))
        if sizes is not None:
            sizes.append({s: len(ds[s]) for s in parts})
    return {s: concatenate_datasets(p) for s, p in parts.items()}


def cache_compute(cfg: Config, backbone) -> str:
    """The dtype the cache runs the backbone in: distillation's (data.distill.autocast)."""
    from mtp_train.backbone import resolve_autocast

    return resolve_autocast(backbone.device, cfg.data.distill.autocast)


FROM_CONFIG = "from-config"  # aux_layers not given: those of cfg.heads (None: heads that read none)


def cache_location(cfg: Config, backbone, aux_layers=FROM_CONFIG) -> tuple[str, Path]:
    """(key, folder) of the hidden-state cache for this config's data, backbone and row length, and
    the auxiliary layers the heads read (`aux_layers`: the loaded heads'; by default cfg.heads')."""
    from mtp_train.data.cache import STATES_DTYPE, cache_key
    from mtp_train.heads.persist import aux_layers_for

    aux = aux_layers_for(cfg.heads, backbone.config) if aux_layers == FROM_CONFIG else aux_layers
    key = cache_key(layout.data_dirs(cfg), backbone.identity, layout.max_length(cfg), STATES_DTYPE,
                    cache_compute(cfg, backbone), aux)
    return key, layout.cache_dir(cfg.data.output_dir, key)


def open_cache(cfg: Config, backbone, aux_layers=FROM_CONFIG):
    """The hidden-state cache for exactly these data, backbone and length (and auxiliary layers), if
    one was built."""
    from mtp_train.data.cache import HiddenCache

    if not cfg.train.use_cache:
        return None
    key, path = cache_location(cfg, backbone, aux_layers)
    m = read_manifest(path)
    if m is None or m.get("config_hash") != key:
        log.info("no hidden-state cache for these inputs (mtp-prep stage=cache builds one); "
                 "running the backbone live")
        return None
    log.info("training from the hidden-state cache %s (%s tokens)", path, f"{m['tokens']:,}")
    return HiddenCache(path, vocab_size=backbone.vocab_size)


def labelled_data_config(cfg: Config):
    """The data settings with the labelled dataset's folder as output (what the data stage hashes)."""
    return dataclasses.replace(cfg.data, output_dir=str(layout.labelled_dir(cfg)))


def check_labelled_is_current(cfg: Config, tokenizer) -> None:
    from mtp_train.data.sources import data_stage_hash

    m = read_manifest(layout.labelled_dir(cfg))
    wanted = data_stage_hash(labelled_data_config(cfg), tokenizer, cfg.data.distill.enabled)
    if m is None or m.get("config_hash") != wanted:
        raise DataError(f"{layout.labelled_dir(cfg)} is missing or was built with other data settings; "
                        f"run `mtp-prep stage=data` (or stage=all) with the same overrides first"
                        + (" (backbone=tiny included)" if cfg.data.source == "tiny" else ""))


def check_prepared_is_current(cfg: Config, tokenizer) -> None:
    """The datasets mtp-train reads were prepared from this config's data settings: the labelled
    dataset's hash matches them and the distilled one was made from that labelled dataset."""
    check_labelled_is_current(cfg, tokenizer)
    distilled, labelled = layout.distilled_dir(cfg), layout.labelled_dir(cfg)
    if distilled in layout.data_dirs(cfg):
        m, source = read_manifest(distilled), read_manifest(labelled)
        if m is None or m.get("source_hash") != source.get("config_hash"):
            raise DataError(f"{distilled} is missing or was distilled from other data than "
                            f"{labelled}; run `mtp-prep stage=all` with the same overrides first")
