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


def _row_and_position(starts, at: int, first_row: int) -> tuple[int, int]:
    """(row, position in it) of flat token index `at`, rows starting at `starts` (+ first_row rows before)."""
    import numpy as np

    row = int(np.searchsorted(starts, at, side="right")) - 1
    return first_row + row, at - int(starts[row])


def check_rows(rows, where: str, vocab_size: int | None = None) -> None:
    """Refuse rows that would train on the wrong targets: input_ids and labels of different lengths,
    a label that is neither IGNORE nor the token at its position (labels mark the answer tokens
    themselves; a damaged file can turn prompt tokens into targets), token ids outside the
    vocabulary. Vectorised over the arrow columns."""
    import numpy as np
    import pyarrow.compute as pc

    from mtp_train.depth_targets import IGNORE

    damaged = "the prepared dataset is damaged: delete it and rerun the mtp-prep stage that wrote it"
    first_row = 0
    for table in rows.with_format("arrow").iter(batch_size=8192):  # in pieces: bounded memory
        ids_col, lab_col = table["input_ids"], table["labels"]
        n_ids = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
        n_lab = pc.list_value_length(lab_col).to_numpy(zero_copy_only=False)
        if (bad := np.flatnonzero(n_ids != n_lab)).size:
            i = int(bad[0])
            raise DataError(f"{where}: row {first_row + i} has {n_ids[i]} input_ids and {n_lab[i]} labels; {damaged}")
        ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False)
        labels = pc.list_flatten(lab_col).to_numpy(zero_copy_only=False)
        starts = np.concatenate([[0], np.cumsum(n_ids)])
        if (wrong := np.flatnonzero((labels != IGNORE) & (labels != ids))).size:
            at = int(wrong[0])
            row, pos = _row_and_position(starts, at, first_row)
            raise DataError(f"{where}: row {row}, position {pos}: label {labels[at]} is neither {IGNORE} "
                            f"nor the token there ({ids[at]}); {damaged}")
        if vocab_size is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            at = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
            row, pos = _row_and_position(starts, at, first_row)
            raise DataError(f"{where}: row {row}, position {pos}: token id {ids[at]} is outside the "
                            f"backbone's vocabulary [0, {vocab_size}) (prepared for another tokenizer, or damaged)")
        first_row += len(n_ids)


def load_splits(dirs: list[Path], sizes: list[dict] | None = None, vocab_size: int | None = None):
    """Concatenate the train and validation splits of the prepared datasets in `dirs`, each checked
    (`check_rows`; token ids against `vocab_size` when given); `sizes`, when given, receives each
    dataset's {split: rows} in order."""
    from datasets import concatenate_datasets

    parts = {"train": [], "validation": []}
    for d in dirs:
        ds = load_prepared(d, "run `mtp-prep` with the same backbone= and data= first")
        for s in parts:
            parts[s].append(ds[s].select_columns(COLUMNS))
            check_rows(parts[s][-1], f"{d}/{s}", vocab_size)
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
