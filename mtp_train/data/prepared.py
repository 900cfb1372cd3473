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
    reached = reached_train_rows(dirs)
    for d in dirs:
        ds = load_prepared(d, "run `mtp-prep` with the same backbone= and data= first")
        if (n := reached.get(Path(d))) is not None and n < len(ds["train"]):
            ds["train"] = ds["train"].select(range(n))
        for s in parts:
            parts[s].append(ds[s].select_columns(COLUMNS))
            check_rows(parts[s][-1], f"{d}/{s}", vocab_size)
        if sizes is not None:
            sizes.append({s: len(ds[s]) for s in parts})
    return {s: concatenate_datasets(p) for s, p in parts.items()}


def reached_train_rows(dirs: list[Path]) -> dict[Path, int]:
    """{labelled dir: train rows to read} for each labelled dataset in `dirs` whose distillation in
    `dirs` a deadline stopped (its manifest's `stopped_at_budget`): its original answers are read for
    the conversations distillation reached only, so the cache and training scale with the time the
    machine had, not with data.max_conversations (docs/training.md, "A pipeline's deadline")."""
    manifests = {Path(d): read_manifest(Path(d)) or {} for d in dirs}
    out = {}
    for m in manifests.values():
        if stop := m.get("stopped_at_budget"):
            for d, other in manifests.items():
                if other.get("stage") != "distill" and other.get("config_hash") == m.get("source_hash"):
                    out[d] = int(stop["train_prompts"])
    return out


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
    if (path / layout.MANIFEST).exists() and (not isinstance(m, dict) or m.get("config_hash") != key):
        # written atomically and named by its key: a manifest that does not parse or names another key
        # was edited or damaged; training would otherwise fall back to the live backbone without a word
        what = "not a readable JSON object" if not isinstance(m, dict) else f"records key {m.get('config_hash')!r}"
        raise DataError(f"{path / layout.MANIFEST}: {what}, not this cache's {key!r}; the cache is damaged: "
                        "delete it and run `mtp-prep stage=cache` again")
    if m is None:
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


def distill_plan(source_manifest: dict, backbone_name: str, tokenizer, cfg, max_length: int, device,
                 backbone_identity: dict | None = None) -> dict:
    """What self-distilled rows are made from (data_prep/distill.py hashes it into their manifest;
    mtp-train compares the rows it is given with it): the labelled source, the backbone and its
    tokenizer, the generation settings and the row length."""
    from mtp_train.backbone import resolve_autocast
    from mtp_train.data.sources import tokenizer_identity

    gen = {k: getattr(cfg, k) for k in ("max_new_tokens", "max_prompt_tokens", "do_sample",
                                         "batch_size", "shard_size", "max_train_prompts",
                                         "max_val_prompts", "seed", "keep_states")}
    gen["autocast"] = resolve_autocast(device, cfg.autocast)
    if cfg.engine != "hf":  # absent for HF generate, so the rows it made before keep their hash
        gen["engine"] = cfg.engine
    if cfg.do_sample:
        gen.update(temperature=cfg.temperature, top_p=cfg.top_p)
    return {"source_hash": source_manifest["config_hash"], "backbone": backbone_name,
            "backbone_identity": backbone_identity,
            "tokenizer": tokenizer_identity(tokenizer), "generation": gen, "max_length": max_length}


def check_distilled_matches(cfg: Config, manifest: dict, backbone) -> None:
    """The distilled rows were made by this backbone (its identity: weights, seed, converted file)
    with these data.distill settings and row length; the compute dtype (autocast) may differ, as
    between machines. Names the first setting that differs."""
    want = distill_plan({"config_hash": manifest.get("source_hash")}, backbone.name, backbone.tokenizer,
                        cfg.data.distill, cfg.data.max_length, backbone.device, backbone.identity)
    where = layout.distilled_dir(cfg)
    fix = "run `mtp-prep stage=all` with the same overrides first"
    if manifest.get("backbone_identity") != want["backbone_identity"] or manifest.get("backbone") != want["backbone"]:
        raise DataError(f"{where} was distilled by another backbone than this one ({manifest.get('backbone')}, "
                        f"identity {manifest.get('backbone_identity')}); {fix}")
    if manifest.get("tokenizer") != want["tokenizer"]:
        raise DataError(f"{where} was distilled with another tokenizer; {fix}")
    if manifest.get("max_length") != want["max_length"]:
        raise DataError(f"data.max_length: {where} was distilled with {manifest.get('max_length')}, this run says "
                        f"{want['max_length']}; {fix}")
    made = dict(manifest.get("generation") or {})
    for key in sorted(set(made) | set(want["generation"])):
        if key != "autocast" and made.get(key) != want["generation"].get(key):
            raise DataError(f"data.distill.{key}: {where} was distilled with {made.get(key)!r}, this run says "
                            f"{want['generation'].get(key)!r}; {fix}")


def check_prepared_is_current(cfg: Config, tokenizer, backbone=None) -> None:
    """The datasets mtp-train reads were prepared from this config's data settings: the labelled
    dataset's hash matches them and the distilled one was made from that labelled dataset, and
    (given the backbone) by this backbone with these data.distill settings."""
    check_labelled_is_current(cfg, tokenizer)
    distilled, labelled = layout.distilled_dir(cfg), layout.labelled_dir(cfg)
    if distilled in layout.data_dirs(cfg):
        m, source = read_manifest(distilled), read_manifest(labelled)
        if m is None or m.get("source_hash") != source.get("config_hash"):
            raise DataError(f"{distilled} is missing or was distilled from other data than "
                            f"{labelled}; run `mtp-prep stage=all` with the same overrides first")
        if backbone is not None:
            check_distilled_matches(cfg, m, backbone)
