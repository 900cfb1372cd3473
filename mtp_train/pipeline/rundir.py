"""The run-directory policy of mtp-train (docs/architecture.md, "Run directories"): what a run
directory is keyed by, when it is finished, resumed or superseded, and the checks that refuse to
resume checkpoints made for something else."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from mtp_train import layout
from mtp_train.config import Config
from mtp_train.errors import ConfigError, MtpError
from mtp_train.layout import HEADS_FILE, HEADS_META, TREE_STATS, data_dirs

log = logging.getLogger(__name__)


# train.* keys that change neither the heads nor their checkpoints: outside the recipe hash
# (compile: the same weights either way, a test holds it)
METRIC_ONLY = ("num_workers", "use_cache", "eval_after", "sampled_tau_temperatures", "compile")
# how long training runs: like trainer.max_steps, part of `finished`, not of the recipe
LENGTH_ONLY = ("time_budget_min", "min_steps")
# trainer keys that change what the weights become, with conf/trainer/default.yaml's values: one set
# to anything else is part of the recipe (a run with other clipping or accumulation is another run;
# the defaults stay out, so recipes from before this rule keep their hashes)
TRAINER_RECIPE_KEYS = {"accumulate_grad_batches": 1, "gradient_clip_val": 1.0, "gradient_clip_algorithm": None,
                       "limit_train_batches": 1.0, "overfit_batches": 0.0, "devices": 1, "num_nodes": 1}


def recipe_keys(cfg: Config) -> tuple[str, str]:
    """(recipe, finished) hashes of a training run, computed without loading anything.

    The recipe is what the checkpoints depend on: backbone weights, prepared data (their manifests'
    hashes), row length, heads, loss, optimiser and seed; a run directory whose checkpoints were made
    for another recipe starts over. `finished` adds the run's length and precision: heads written
    under the same `finished` hash are up to date and the run is skipped (force=true trains again).
    Changing only trainer.max_steps (or the time budget) keeps the recipe, so a longer run resumes
    from last.ckpt."""
    from mtp_train.artifacts import config_hash, read_manifest
    from mtp_train.backbone import backbone_identity

    structured = lambda x: OmegaConf.to_container(OmegaConf.structured(x))  # noqa: E731
    train = {k: v for k, v in structured(cfg.train).items() if k not in METRIC_ONLY + LENGTH_ONLY}
    data = [(read_manifest(d) or {}).get("config_hash") for d in data_dirs(cfg)]
    lora = structured(cfg.backbone.lora) if cfg.backbone.lora.enabled else None
    t = cfg.trainer
    trainer = {k: t.get(k, v) for k, v in TRAINER_RECIPE_KEYS.items() if t.get(k, v) != v}
    heads = structured(cfg.heads)
    if cfg.heads.from_speculators:  # the drafter's weights, not only where they are
        from mtp_train.artifacts import file_sha256

        f = Path(cfg.heads.from_speculators) / "model.safetensors"
        heads["from_speculators"] = [heads["from_speculators"], file_sha256(f) if f.is_file() else None]
    recipe = config_hash({"backbone": {**backbone_identity(cfg.backbone), "lora": lora}, "data": data,
                          "max_length": layout.max_length(cfg),
                          "heads": heads, "loss": structured(cfg.loss), "train": train,
                          "seed": cfg.seed, **({"trainer": trainer} if trainer else {})})
    # a run to a deadline is finished whatever the deadline's time (make demo run again skips it)
    budget = {k: getattr(cfg.train, k) for k in LENGTH_ONLY} | {"deadline": cfg.budget.deadline is not None}
    finished = config_hash({"recipe": recipe, "max_steps": t.get("max_steps"),
                            "max_epochs": t.get("max_epochs"), "precision": str(t.get("precision")),
                            **({"budget": budget} if budget["time_budget_min"] or budget["deadline"] else {})})
    return recipe, finished


def finished_run(run_dir: Path, finished: str) -> dict | None:
    """The metrics of heads this run directory already holds for exactly this recipe and length."""
    from mtp_train.artifacts import read_json

    meta = read_json(run_dir / HEADS_META)
    if meta and (meta.get("recipe") or {}).get("finished") == finished and (run_dir / HEADS_FILE).is_file():
        from mtp_train.heads.persist import check_weights_digest

        check_weights_digest(meta, run_dir / HEADS_FILE)  # a damaged file is not a finished run
        return meta
    return None


SUPERSEDED_ITEMS = (layout.CHECKPOINTS, HEADS_FILE, HEADS_META, layout.ADAPTER_DIR, TREE_STATS, layout.RUN_META,
                    layout.CSV_LOGS)


def supersede(run_dir: Path, old_recipe: str) -> Path:
    """Move what a run directory holds for another recipe (checkpoints, heads, logs) to
    <run>/superseded/<old recipe>/, so a changed config trains afresh and loses nothing. A recipe
    superseded before (force=true twice, or switching back and forth; the recipe does not hold
    max_steps, so a long and a short run share it) gets a new directory, <old recipe>-2, -3, ...:
    nothing moved there earlier is ever deleted."""
    base = run_dir / layout.SUPERSEDED / old_recipe
    dest, n = base, 1
    while dest.exists() and any((dest / name).exists() for name in SUPERSEDED_ITEMS):
        n += 1
        dest = base.with_name(f"{old_recipe}-{n}")
    dest.mkdir(parents=True, exist_ok=True)
    for name in SUPERSEDED_ITEMS:
        src = run_dir / name
        if src.exists():
            os.replace(src, dest / name)
    return dest


def check_resume_matches(run_dir: Path, heads, backbone, cfg: Config, resuming: bool,
                         write: bool = True, recipe: str | None = None, precision: str | None = None) -> None:
    """A run directory remembers what its checkpoints were made for; resuming with other heads or
    another backbone is refused before Lightning tries (and fails deep inside) to load them. It also
    keeps the precisions the run trained in, in order (`precisions`: a resume in another one adds it)."""
    from mtp_train.artifacts import read_json, write_json_atomic

    meta = {"backbone": backbone.name, "hidden_size": backbone.hidden_size,
            "vocab_size": backbone.vocab_size, "head_type": cfg.heads.type, "k": cfg.heads.k,
            "heads": {n: list(t.shape) for n, t in heads.state_dict().items()}, "recipe": recipe,
            "fingerprint": backbone.fingerprint()}  # export --checkpoint checks a foreign run's weights
    old = read_json(run_dir / layout.RUN_META)
    before = list((old or {}).get("precisions") or []) if resuming else []
    meta["precisions"] = before + ([precision] if precision and (not before or before[-1] != precision) else [])
    if resuming and old is not None:
        for key in ("backbone", "hidden_size", "vocab_size", "head_type", "k", "heads"):
            if old.get(key) != meta[key]:
                shown = "parameter shapes" if key == "heads" else f"{old.get(key)!r} -> {meta[key]!r}"
                raise ConfigError(
                    f"{run_dir / layout.CHECKPOINTS} was made with another {key} ({shown}); use a new "
                    "hydra.run.dir, or the same backbone= and heads= settings to resume")
    if write:
        write_json_atomic(run_dir / layout.RUN_META, meta)


@contextlib.contextmanager
def resume_loads_weights_only(last: Path | None):
    """Resuming never unpickles code: Lightning is asked for a weights-only load of a checkpoint
    file (where its version has the switch), and a ZeRO directory is read with every torch.load
    forced weights-only, DeepSpeed's own record types allowed (`distributed.weights_only_loads`)."""
    import inspect

    import lightning as L

    extra = {"weights_only": True} if "weights_only" in inspect.signature(L.Trainer.fit).parameters else {}
    if last is None or not last.is_dir():
        yield extra
        return
    from mtp_train.distributed import weights_only_loads, zero_file_types

    with weights_only_loads(zero_file_types()):
        yield extra


def check_readable(last: Path, run_dir: Path) -> dict | None:
    """A checkpoint cut short (a kill while it was being saved) is refused with the way out, before
    Lightning fails on it deep inside; a ZeRO directory is left to DeepSpeed. Returns the
    checkpoint, memory-mapped (None for a ZeRO directory)."""
    from mtp_train.distributed import CheckpointRefused, CheckpointUnreadable, load_weights_only

    if not last.is_file():
        return None
    try:
        ckpt = load_weights_only(last, mmap=True)
    except CheckpointRefused as e:  # intact, but holds objects a weights-only load refuses
        raise MtpError(f"{last}: refusing to resume from it: it holds more than tensors and plain values, "
                       f"and loading it could run code (it names {e.name}); force=true trains afresh") from None
    except CheckpointUnreadable as e:
        raise MtpError(f"{last}: cannot be read ({e.detail}); it was probably cut off while being saved. "
                       f"Rerun with force=true to train afresh (what {run_dir} holds now moves to "
                       f"{run_dir / layout.SUPERSEDED})") from None
    return ckpt if isinstance(ckpt, dict) else {}


@dataclass
class RunDir:
    recipe: str
    finished: str
    finished_meta: dict | None  # heads.json of heads already trained with this recipe and length
    has_tree_stats: bool  # those heads have their rank statistics (else one validation records them)
    # what the directory holds is for another recipe (or force=true): moved aside by
    # apply_supersede once every check of the new run has passed (None: nothing to move)
    supersede: str | None = None
    reason: str = ""


def open_run_dir(cfg: Config, run_dir: Path) -> RunDir:
    """What `run_dir` holds for this config: heads already finished with this recipe and length
    (skipped), checkpoints of the same recipe (resumed by the caller), or checkpoints and heads of
    another recipe or `force=true`, which `apply_supersede` moves to superseded/<old recipe>/ once
    the new run's own checks have passed (a command refused for its data or backbone leaves a
    finished run where it was). Nothing is moved here."""
    from mtp_train.artifacts import read_json

    recipe, finished = recipe_keys(cfg)
    done = None if cfg.force else finished_run(run_dir, finished)
    state = RunDir(recipe, finished, done, (run_dir / TREE_STATS).is_file())
    if done is not None:
        if state.has_tree_stats:
            log.info("%s already holds heads trained with this recipe and length; skipping "
                     "(force=true trains again)", run_dir)
        else:
            log.info("%s holds heads trained with this recipe but no %s: validating once to record them",
                     run_dir, TREE_STATS)
        return state
    old_recipe = (read_json(run_dir / layout.RUN_META) or {}).get("recipe")
    if (cfg.force or (old_recipe and old_recipe != recipe)) and any(
            (run_dir / n).exists() for n in (layout.CHECKPOINTS, HEADS_FILE)):
        state.supersede = old_recipe or "unknown"
        state.reason = "force=true" if cfg.force else "the recipe changed"
    return state


def apply_supersede(run_dir: Path, state: RunDir) -> None:
    """Move what the directory holds for another recipe aside (rank 0), just before training."""
    from mtp_train.runlock import is_rank_zero

    if state.supersede is not None and is_rank_zero():
        where = supersede(run_dir, state.supersede)
        log.warning("%s: %s; its checkpoints and heads moved to %s, training afresh", run_dir, state.reason, where)
        state.supersede = None


def check_checkpoint_shapes(last: Path, ckpt: dict, heads) -> None:
    """The heads' parameters in a checkpoint (`check_readable`'s) have these heads' names and shapes
    (a directory without run_meta.json says nothing of what its checkpoint was made for)."""
    from mtp_train.distributed import heads_from_module_state

    state = heads_from_module_state(ckpt.get("state_dict") or {})
    want = {n: tuple(t.shape) for n, t in heads.state_dict().items()}
    got = {n: tuple(t.shape) for n, t in state.items() if hasattr(t, "shape")}
    if state and got != want:
        differ = sorted(n for n in set(want) | set(got) if want.get(n) != got.get(n))
        raise ConfigError(f"{last} holds other heads than these (parameters {differ[:3]} differ in name or "
                          "shape); use a new hydra.run.dir, or the heads= settings it was made with")


def check_resume(run_dir: Path, last: Path, heads, backbone, cfg: Config, recipe: str, write: bool,
                 precision: str | None = None) -> bool:
    """Whether training resumes from `last` (checkpoints/last.ckpt): refused when it was made for
    other heads or another backbone, is unreadable, or is already past trainer.max_steps. Records
    what the checkpoints are made for (run_meta.json) when `write`."""
    resuming = last.exists()
    check_resume_matches(run_dir, heads, backbone, cfg, resuming=resuming, write=write, recipe=recipe,
                         precision=precision)
    if resuming:
        ckpt = check_readable(last, run_dir)
        step = None
        if ckpt is not None:  # a file (a ZeRO directory is left to DeepSpeed)
            check_checkpoint_shapes(last, ckpt, heads)
            step = ckpt.get("global_step") if isinstance(ckpt.get("global_step"), int) else None
        max_steps = cfg.trainer.get("max_steps") or -1
        if step is not None and max_steps > 0 and step > max_steps:
            raise ConfigError(f"trainer.max_steps: {last} is already at step {step}, past the {max_steps} "
                              f"asked for; force=true trains {max_steps} steps afresh (the longer run moves "
                              "to superseded/)")
        log.info("resuming from %s", last)
    return resuming
