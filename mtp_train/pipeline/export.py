"""The library behind `mtp-export-heads` (mtp_train/cli/export.py): heads.safetensors from a checkpoint,
and the saved recipe of a training run."""

from __future__ import annotations

import logging
from pathlib import Path

from mtp_train import layout
from mtp_train.errors import MtpError

log = logging.getLogger(__name__)


def checkpoint_state(path: Path) -> dict:
    """The module state dict of a checkpoint: a ZeRO directory or a Lightning checkpoint file."""
    return load_checkpoint(path)[0]


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a Lightning checkpoint file was saved at (None for a ZeRO directory)."""
    return load_checkpoint(path)[1]


def load_checkpoint(path: Path) -> tuple[dict, int | None]:
    """(module state dict, global step) of a checkpoint, read once; the step is None for a ZeRO
    directory."""
    from mtp_train.distributed import (
        CheckpointRefused,
        CheckpointUnreadable,
        load_weights_only,
        zero_state_dict,
    )

    if path.is_dir():
        return zero_state_dict(path), None
    if not path.is_file():
        raise MtpError(f"{path}: no checkpoint here")
    try:  # tensors and plain containers only: never unpickle arbitrary objects
        ckpt = load_weights_only(path)
    except CheckpointRefused as e:
        raise MtpError(f"{path}: refusing to load it: it holds more than tensors and plain values, and "
                       f"loading it could run code (it names {e.name})") from None
    except CheckpointUnreadable as e:
        raise MtpError(f"{path}: not a readable checkpoint ({e.detail})") from None
    if not isinstance(ckpt, dict):
        raise MtpError(f"{path}: not a Lightning checkpoint (a {type(ckpt).__name__}, not a dict)")
    if "state_dict" not in ckpt:
        raise MtpError(f"{path}: not a Lightning checkpoint (no state_dict)")
    step = ckpt.get("global_step")
    return ckpt["state_dict"], int(step) if isinstance(step, int) else None


def check_checkpoint_backbone(checkpoint: Path, backbone, cfg) -> None:
    """A checkpoint from another run directory (--checkpoint) whose run trained on other backbone
    weights is refused as mtp-eval refuses such heads (its run_meta.json records the weights'
    fingerprint; runs from before that record are not checked)."""
    from mtp_train.artifacts import read_json
    from mtp_train.errors import ConfigError

    run_meta = read_json(checkpoint.resolve().parent.parent / layout.RUN_META) or {}
    theirs = run_meta.get("fingerprint")
    if theirs and theirs != backbone.fingerprint() and not cfg.backbone.allow_foreign_heads:
        raise ConfigError(f"{checkpoint}: trained on another backbone (weights fingerprint {theirs}, this run's "
                          f"backbone has {backbone.fingerprint()}); backbone.allow_foreign_heads=true exports it "
                          "anyway")


def recipe_file(run_dir: Path) -> Path:
    """Where a run's config is: <run>/run_config.yaml, which mtp-train writes under the run
    directory's lock (not Hydra's <run>/.hydra/config.yaml, which a command refused on the same
    directory may have written over)."""
    from mtp_train.layout import RUN_CONFIG

    return Path(run_dir) / RUN_CONFIG


def load_recipe(run_dir: Path):
    """The typed config a run was started with (`recipe_file`)."""
    from omegaconf import OmegaConf

    from mtp_train.config import Config
    from mtp_train.config_rules import validate

    recipe = recipe_file(run_dir)
    if not recipe.is_file():
        raise MtpError(f"{recipe}: missing; export needs the config the run was started with")
    import yaml

    try:
        raw = OmegaConf.load(recipe)
    except yaml.YAMLError as e:  # a planted tag is refused by the loader, never constructed
        raise MtpError(f"{recipe}: not a config mtp-train wrote ({str(e).splitlines()[0]})") from None
    raw.paths.output_dir = str(run_dir)  # saved as ${hydra:...}, which resolves only inside Hydra
    for section in ("eval", "clp"):  # other commands' settings: no part of the recipe export reads
        raw.pop(section, None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except Exception as e:
        raise MtpError(f"{recipe}: not a config of this version of mtp-train ({e})") from e
    return validate(merged, command="train")  # the recipe as mtp-train judged it


def export_heads(run_dir: Path, checkpoint: Path | None = None) -> Path:
    from mtp_train.runlock import run_lock

    if not Path(run_dir).is_dir():
        raise MtpError(f"{run_dir}: no run directory here")
    with run_lock(Path(run_dir), "mtp-export-heads"):
        return _export_heads(run_dir, checkpoint)


def _export_heads(run_dir: Path, checkpoint: Path | None = None) -> Path:
    import torch

    from mtp_train.backbone import load_backbone
    from mtp_train.distributed import heads_from_module_state
    from mtp_train.heads.persist import build_heads, heads_state_dict
    from mtp_train.pipeline.training import save_heads

    run_dir = Path(run_dir)
    recipe = recipe_file(run_dir)
    cfg = load_recipe(run_dir)
    checkpoint = Path(checkpoint) if checkpoint else layout.last_checkpoint(run_dir)
    module_state, step = load_checkpoint(checkpoint)
    state = heads_from_module_state(module_state)
    if not state:
        raise MtpError(f"{checkpoint}: holds no heads parameters")
    backbone = load_backbone(cfg.backbone)
    draft_ids = state.get("draft_ids")
    heads = build_heads(cfg.heads, backbone, draft_ids=draft_ids.long() if draft_ids is not None else None)
    wanted = heads_state_dict(heads)
    missing = sorted(set(wanted) - set(state))
    extra = sorted(set(state) - set(wanted) - {"draft_ids"})
    bad = [n for n in wanted if n in state and tuple(state[n].shape) != tuple(wanted[n].shape)]
    if missing or extra or bad:
        raise MtpError(f"{checkpoint}: does not match heads={cfg.heads.type} k={cfg.heads.k} of "
                       f"{recipe} (missing {missing[:3]}, not in these heads {extra[:3]}, other shapes "
                       f"{bad[:3]})")
    with torch.no_grad():
        for name, t in heads.state_dict().items():
            if name in wanted:
                t.copy_(state[name].to(t.dtype))
    if cfg.backbone.lora.enabled:  # the adapters trained with these heads are in the checkpoint too
        load_adapters_from(module_state, checkpoint, backbone)
    from mtp_train.artifacts import read_json

    check_checkpoint_backbone(checkpoint, backbone, cfg)
    own = checkpoint.resolve() == (layout.last_checkpoint(run_dir)).resolve()
    meta = (read_json(run_dir / layout.HEADS_META) or {}) if own else {}
    trained = (meta.get("recipe") or {}).get("steps")
    if own and step is not None and trained is not None and step != trained:
        # heads.json's figures and tree statistics describe the weights after `trained` steps, not these
        log.warning("%s is at step %d, the heads the run wrote are from step %d: its validation figures and "
                    "tree statistics are not carried over", checkpoint, step, trained)
        own, meta = False, {}
    old = meta.get("metrics") or {}
    metrics = {**{k: v for k, v in old.items() if k != "exported_from"}, "exported_from": str(checkpoint)}
    if not own:  # the run's validation figures and tree statistics describe its own last weights
        if (run_dir / layout.TREE_STATS).exists():
            (run_dir / layout.TREE_STATS).unlink()
            log.warning("%s: removed %s (it described the run's own weights); run mtp-train on the run "
                        "directory to record it for these", run_dir, layout.TREE_STATS)
    # the run's own weights keep what made them (steps, rows, the cache); others are of unknown make
    run = meta.get("run") or {}  # the run's own weights keep how long and on how many devices they trained
    path = save_heads(run_dir, heads, backbone, cfg, metrics=metrics, recipe=meta.get("recipe"),
                      world_size=run.get("world_size") or 1, elapsed_s=run.get("elapsed_s"))
    log.info("heads written to %s", path)
    return path


def load_adapters_from(module_state: dict, checkpoint: Path, backbone) -> None:
    """Give the backbone (whose LoRA layers backbone.lora injected) the adapters of a checkpoint's
    module state."""
    from mtp_train.adapters import adapter_modules
    from mtp_train.distributed import heads_from_module_state

    state = heads_from_module_state(module_state, part="adapters")
    if not state:
        raise MtpError(f"{checkpoint}: the recipe trains LoRA adapters (backbone.lora.enabled), but the "
                       "checkpoint holds none")
    container = adapter_modules(backbone.model)
    missing, unexpected = container.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise MtpError(f"{checkpoint}: its adapters do not match backbone.lora of the recipe (missing "
                       f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
