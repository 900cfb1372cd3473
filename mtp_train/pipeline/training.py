"""The library behind `mtp-train` (mtp_train/cli/train.py): train k draft heads on a frozen backbone; writes heads.safetensors + heads.json."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
import warnings
from pathlib import Path

from omegaconf import OmegaConf

from mtp_train import layout
from mtp_train.config import Config
from mtp_train.data.prepared import open_cache
from mtp_train.errors import ConfigError
from mtp_train.instantiate import instantiate
from mtp_train.layout import HEADS_FILE, HEADS_META, TREE_STATS, data_dirs
from mtp_train.pipeline.rundir import (
    apply_supersede,
    check_resume,
    open_run_dir,
    resume_loads_weights_only,
)

log = logging.getLogger(__name__)


def draft_vocab_for(cfg: Config, backbone):
    """heads.draft_vocab=N: the N most frequent assistant tokens of the training split (plus the end
    of turn), as sorted token ids; None when the heads score the whole vocabulary (N null, or at
    least the backbone's vocabulary size: the setting is a cap)."""
    n = cfg.heads.draft_vocab
    if n is None:
        return None
    if n >= backbone.vocab_size:
        log.warning("heads.draft_vocab=%d is not below the backbone's vocabulary (%d tokens): the heads score "
                    "the whole vocabulary", n, backbone.vocab_size)
        return None
    from mtp_train.data.prepared import load_splits
    from mtp_train.heads.vocab import label_token_counts, select_draft_vocab

    counts = label_token_counts(load_splits(data_dirs(cfg), vocab_size=backbone.vocab_size)["train"],
                                backbone.vocab_size)
    special = tuple(t for t in (backbone.tokenizer.eos_token_id, backbone.tokenizer.pad_token_id)
                    if t is not None)
    ids = select_draft_vocab(counts, n, always=special)
    covered = counts[ids.numpy()].sum() / max(1, counts.sum())
    log.info("draft vocabulary: %d of %d tokens, covering %.1f%% of the training targets",
             len(ids), backbone.vocab_size, 100 * covered)
    return ids


def labelled_hash(cfg: Config) -> str | None:
    from mtp_train.artifacts import read_manifest

    return (read_manifest(layout.labelled_dir(cfg)) or {}).get("config_hash")


def make_loggers(cfg) -> list:
    """The configured loggers; in a multirun, W&B runs are named, grouped and tagged after the point
    and the CSV logger writes to csv/<point name> (mtp_train/tracking.py)."""
    from mtp_train.tracking import identity, offline_without_key

    ident = identity(cfg.experiment_name, "train")
    loggers = []
    for name, lcfg in (cfg.logger or {}).items():
        lcfg = dict(lcfg)
        if name == "wandb":
            if offline_without_key():
                lcfg["offline"] = True
            own = {k: v for k, v in lcfg.items()  # a name or group the user set stays
                   if v is not None and not (k == "name" and v == cfg.experiment_name)}
            lcfg = {**lcfg, **ident.wandb_kwargs(), **own}
        elif name == "csv" and ident.group:  # csv/<point>/version_<n>: a requeued point adds a version
            lcfg["name"] = f"{lcfg.get('name') or layout.CSV_LOGS}/{ident.name}"
        loggers.append(instantiate(lcfg))
    return loggers


def close_loggers(loggers: list) -> None:
    """Finish W&B runs so the offline run directory is complete (and a sweep's next job starts anew)."""
    from lightning.pytorch.loggers import WandbLogger

    for lg in loggers:
        if isinstance(lg, WandbLogger):
            lg.experiment.finish()


def fit_fc_to_final_state(heads, dm, backbone, max_tokens: int = 32768) -> None:
    """EAGLE-3's `heads.init=final_state`: fit fc on the first training rows' real tokens (the
    cache's states, or the backbone run live), at most `max_tokens` of them."""
    import torch

    dm.setup()
    rows, aux, final, n = dm.splits["train"], [], [], 0
    for i in range(len(rows)):
        batch = dm.collate([rows[i]])
        keep = batch["attention_mask"][0].bool()
        if "aux" in batch:
            h, a = batch["hidden"][0], batch["aux"][0]
        else:
            with torch.no_grad():
                h, a = backbone.hidden_and_aux(batch["input_ids"].to(backbone.device),
                                               batch["attention_mask"].to(backbone.device), heads.aux_layers)
            h, a = h[0].cpu(), a[0].cpu()
        aux.append(a[keep].float())
        final.append(h[keep].float())
        n += int(keep.sum())
        if n >= max_tokens:
            break
    explained = heads.fit_to_final_state(torch.cat(aux), torch.cat(final))
    log.info("heads.init=final_state: fc fitted on %d tokens; it explains %.1f%% of the final state's "
             "variance", n, 100 * explained)


def save_heads(run_dir: Path, heads, backbone, cfg: Config, metrics: dict, world_size: int = 1,
               elapsed_s: float | None = None, recipe: dict | None = None) -> Path:
    from safetensors.torch import save_file

    from mtp_train.artifacts import check_finite, file_sha256, write_json_atomic
    from mtp_train.heads.persist import heads_state_dict

    state = heads_state_dict(heads)
    check_finite(state, f"{run_dir / HEADS_FILE}: not written, training diverged (lower train.lr or "
                        "check the data)")
    adapter = save_adapters_of(run_dir, backbone, cfg)  # before heads.json, which marks the run finished
    tmp = run_dir / (HEADS_FILE + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, run_dir / HEADS_FILE)
    write_json_atomic(run_dir / HEADS_META, {
        "head_type": cfg.heads.type, "k": cfg.heads.k, "draft_size": heads.draft_size,
        # loading checks the file against it: damaged or edited heads are refused, never decoded
        "weights_sha256": file_sha256(run_dir / HEADS_FILE),
        "heads": OmegaConf.to_container(
            OmegaConf.structured(cfg.heads)),
        "backbone": {"name": backbone.name, "hidden_size": backbone.hidden_size,
                     "vocab_size": backbone.vocab_size, "fingerprint": backbone.fingerprint()},
        "loss": OmegaConf.to_container(OmegaConf.structured(cfg.loss)),
        "train": OmegaConf.to_container(OmegaConf.structured(cfg.train)),
        "metrics": metrics,
        "recipe": recipe,
        "adapter": adapter,
        "run": {"slurm_job_id": os.environ.get("SLURM_JOB_ID"), "host": platform.node(),
                "world_size": world_size, "elapsed_s": elapsed_s},
    })
    return run_dir / HEADS_FILE


def save_adapters_of(run_dir: Path, backbone, cfg: Config) -> dict | None:
    """With backbone.lora: the trained adapters as a PEFT adapter directory beside the heads, and what
    heads.json records of them (folder, weights' sha256, settings); None without."""
    from mtp_train.adapters import WEIGHTS_FILE, has_adapters, save_adapter
    from mtp_train.artifacts import file_sha256

    if not cfg.backbone.lora.enabled or not has_adapters(backbone.model):
        return None
    b = cfg.backbone
    base = b.converted_dir if b.source == "gguf" else b.path
    out = save_adapter(backbone.model, run_dir / layout.ADAPTER_DIR, base_model=base)
    return {"dir": layout.ADAPTER_DIR, "sha256": file_sha256(out / WEIGHTS_FILE),
            "lora": OmegaConf.to_container(OmegaConf.structured(b.lora))}


def record_tree_stats(run_dir: Path, module, trainer, dm, meta: dict) -> dict:
    """Validate finished heads once for the rank statistics token trees are grown from; add the
    tree metric to heads.json (the weights are not touched)."""
    from mtp_train.artifacts import write_json_atomic

    metrics = {k: float(v) for k, v in trainer.validate(module, datamodule=dm, verbose=False)[0].items()}
    if trainer.is_global_zero:
        module.rank_stats.save(run_dir / TREE_STATS)
        meta["metrics"] = {**meta.get("metrics", {}), "val/sim_tau_tree": metrics.get("val/sim_tau_tree")}
        write_json_atomic(run_dir / HEADS_META, meta)
        log.info("%s written (%d positions; val/sim_tau_tree %.3f)", run_dir / TREE_STATS,
                 module.rank_stats.total(), metrics.get("val/sim_tau_tree", float("nan")))
    return meta["metrics"]


def gathered(module, trainer):
    """A context in which every rank holds the full parameters of what trains (heads, and adapters
    with backbone.lora): under ZeRO stage 3 they are partitioned across ranks and must be gathered
    (by all ranks together) before saving."""

    from mtp_train.distributed import zero_config

    if zero_config(trainer.strategy).get("stage") == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def _pin_local_gpu() -> None:
    """With several processes per node, make this rank's GPU the current one before the backbone
    loads, so 8 ranks do not all put a copy (and a CUDA context) on GPU 0 first."""
    import torch

    local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID")
    if local is not None and torch.cuda.is_available() and int(local) < torch.cuda.device_count():
        torch.cuda.set_device(int(local))


def run_train(cfg: Config) -> dict:
    from mtp_train.runlock import run_lock

    with run_lock(Path(cfg.paths.output_dir), "mtp-train"):
        return _run_train(cfg)


def time_budget(cfg: Config, backbone, dm, resuming: bool):
    """(the TimeBudget callback, what heads.json records of how its seconds were found), or
    (None, {}) when training runs trainer.max_steps steps: train.time_budget_min, else the time
    budget.deadline leaves after the stages that follow training (mtp_train/pipeline/budget.py)."""
    from mtp_train.lit.budget import TimeBudget

    t, record = cfg.train, {}
    if t.time_budget_min is not None:
        seconds, relative = 60.0 * t.time_budget_min, False
    elif cfg.budget.deadline is not None:
        from mtp_train.pipeline.budget import PROBE_PROMPT_TOKENS, deadline_training_seconds

        dm.setup()
        row = dm.splits["validation" if len(dm.splits["validation"]) else "train"][0]["input_ids"]
        seconds, record = deadline_training_seconds(cfg, backbone, [int(x) for x in row[:PROBE_PROMPT_TOKENS]])
        relative = True
    else:
        return None, {}
    cap = cfg.trainer.get("max_steps") or -1
    if cap is None or cap < 1:
        raise ConfigError(f"trainer.max_steps: {cap}; with a time budget it is the cap on the planned steps "
                          "and must be a number of steps >= 1")
    if cap < t.min_steps:
        raise ConfigError(f"train.min_steps: {t.min_steps} is above trainer.max_steps={cap}, the cap on a "
                          "time budget's steps")
    record["resumed"] = resuming
    return TimeBudget(seconds, t.min_steps, cap, cfg.trainer.get("val_check_interval"), relative=relative), record


def resolve_precision(cfg: Config, backbone, heads, dm, budget=None) -> tuple[str, dict, tuple[bool, dict] | None]:
    """trainer.precision=auto: bf16-mixed or 32-true, whichever trains faster here, timed on the first
    training batches (mtp_train/lit/step_options.py; on a GPU, bf16-mixed). Other values pass
    through with an empty record. With train.compile=auto too, a CPU with native bf16 and a run long
    enough to time a compile, bf16 is also timed compiled in the same pass; the third value is then
    train.compile's decision (resolve_compile takes it), else None."""
    p = str(cfg.trainer.get("precision"))
    if p != "auto":
        return p, {}, None
    import torch

    if cfg.trainer.get("accelerator") not in (None, "cpu", "auto") or torch.cuda.is_available():
        return "bf16-mixed", {"why": "a GPU"}, None
    if cfg.backbone.lora.enabled:
        return "32-true", {"why": "backbone.lora trains through the live backbone (not timed)"}, None
    from mtp_train.backbone import cpu_has_native_bf16
    from mtp_train.lit.step_options import choose_jointly, choose_precision

    dm.setup()  # the first training batches (the sampler draws from its own seeded generator: the
    # order training then sees is unchanged)
    batches = [b for _, b in zip(range(4), dm.train_dataloader(), strict=False)]
    if len(batches) < 2:
        return "32-true", {"why": "too few training batches to time"}, None
    if cfg.train.compile == "auto" and cpu_has_native_bf16() and compile_untimed(cfg, dm, budget) is None:
        precision, compiled, p_record, c_record = choose_jointly(backbone, heads, cfg.loss, cfg.train, batches)
        return precision, p_record, None if compiled is None else (compiled, c_record)
    return (*choose_precision(backbone, heads, cfg.loss, cfg.train, batches), None)


def compile_untimed(cfg: Config, dm, budget, world_size: int | None = None) -> str | None:
    """Why train.compile=auto trains eager without timing a compile here, or None where it times one.
    world_size None: judged from the config, before the trainer exists (trainer.devices and num_nodes)."""
    strategy = str(cfg.trainer.get("strategy") or "auto")
    if world_size is None:
        devices = cfg.trainer.get("devices")
        world_size = (devices if isinstance(devices, int) else 1 if devices in (None, "auto", "1") else 2) * int(
            cfg.trainer.get("num_nodes") or 1)
    if world_size > 1 or "deepspeed" in strategy:
        return "more than one device or DeepSpeed (compiled heads are tested on one device only)"
    import torch

    if cfg.trainer.get("accelerator") not in (None, "cpu", "auto") or torch.cuda.is_available():
        return "not timed on a GPU (train.compile=on compiles there)"
    if cfg.backbone.lora.enabled:
        return "backbone.lora trains through the live backbone (not timed)"
    from mtp_train.lit.step_options import COMPILE_MIN_SECONDS

    if budget is not None and budget.seconds < COMPILE_MIN_SECONDS:
        return f"a {budget.seconds:.0f} s budget is too short to pay a compile back"
    dm.setup()
    if budget is None and (steps := planned_steps(cfg, dm)) < COMPILE_MIN_STEPS:
        return f"{steps} steps (trainer.max_steps / max_epochs) are too few to pay a compile back"
    return None


def resolve_compile(cfg: Config, backbone, heads, dm, precision: str, budget, world_size: int,
                    timed: tuple[bool, dict] | None = None) -> tuple[bool, dict]:
    """train.compile: whether the heads' forward trains compiled, and why. `auto` times it on a CPU
    on the first training batches in the chosen precision (mtp_train/lit/step_options.py), unless
    the run is too short to pay a compile back or `timed` holds the decision resolve_precision made
    with the precision; `on` compiles without timing."""
    mode = cfg.train.compile
    if mode == "off":
        return False, {}
    strategy = str(cfg.trainer.get("strategy") or "auto")
    if mode == "on":
        if world_size > 1 or "deepspeed" in strategy:
            raise ConfigError(f"train.compile=on: compiled heads are tested on one device only, and this run has "
                              f"{world_size} process(es) with strategy {strategy}; use train.compile=off")
        return True, {"why": "train.compile=on"}
    if why := compile_untimed(cfg, dm, budget, world_size):
        return False, {"why": why}
    if timed is not None:
        return timed
    from mtp_train.lit.step_options import choose_compile

    batches = [b for _, b in zip(range(4), dm.train_dataloader(), strict=False)]
    if len(batches) < 2:
        return False, {"why": "too few training batches to time"}
    return choose_compile(backbone, heads, cfg.loss, cfg.train, batches, precision)


COMPILE_MIN_STEPS = 200  # train.compile=auto without a time budget: fewer steps do not pay a compile back


def planned_steps(cfg: Config, dm) -> int:
    """The optimizer steps a run without a time budget makes: trainer.max_steps, or, where that is
    unbounded (-1 or null), trainer.max_epochs (Lightning's 1000 when unset) passes over the rows."""
    cap = cfg.trainer.get("max_steps")
    if cap is not None and cap >= 0:
        return int(cap)
    epochs = cfg.trainer.get("max_epochs")
    per_epoch = len(dm.train_dataloader()) // max(1, int(cfg.trainer.get("accumulate_grad_batches") or 1))
    return (1000 if epochs is None or epochs < 0 else int(epochs)) * per_epoch


def trained_precision(cfg: Config, meta: dict) -> str:
    """The precision finished heads were trained in (what trainer.precision=auto chose, as heads.json
    records it; float32 when it does not), for the validation a finished run still runs."""
    p = str(cfg.trainer.get("precision"))
    if p != "auto":
        return p
    return ((meta.get("recipe") or {}).get("precision") or {}).get("used") or "32-true"


def budget_trainer_kwargs(cfg: Config, budget, resuming: bool) -> dict:
    """Lightning's own guards around a time budget: min_steps keeps the floor, max_time stops a
    plan that went wrong at a quarter over the budget (not set for a resumed deadline run, whose
    budget counts from its first start)."""
    if budget is None:
        return {}
    out = {} if cfg.trainer.get("min_steps") is not None else {"min_steps": budget.min_steps}
    if cfg.trainer.get("max_time") is None and not (budget.relative and resuming):
        import datetime

        from mtp_train.lit.budget import backstop_s

        out["max_time"] = datetime.timedelta(seconds=backstop_s(budget.seconds))
        budget.widen_timer = True  # our backstop, which follows the floor; a user's max_time is theirs
    return out


def imported_record(src: str) -> dict:
    """Where heads.from_speculators heads came from: the folder and its weights' sha256."""
    from mtp_train.artifacts import file_sha256

    return {"dir": str(Path(src).resolve()), "sha256": file_sha256(Path(src) / "model.safetensors")}


def _run_train(cfg: Config) -> dict:
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from mtp_train.backbone import load_backbone
    from mtp_train.distributed import check_trainer, trainer_plugins
    from mtp_train.heads.persist import build_heads, count_parameters
    from mtp_train.lit.data import MTPDataModule
    from mtp_train.lit.module import MTPHeadsModule
    from mtp_train.tracking import sweep_point

    check_trainer(cfg.trainer, multirun=sweep_point() is not None, heads_given=bool(cfg.heads.from_speculators))
    _pin_local_gpu()
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = open_run_dir(cfg, run_dir)  # finished (skip), to resume, or superseded and fresh
    if state.finished_meta is not None and state.has_tree_stats:
        return state.finished_meta["metrics"]
    done, recipe, finished = state.finished_meta, state.recipe, state.finished
    backbone = load_backbone(cfg.backbone)
    from mtp_train.data.prepared import check_prepared_is_current

    check_prepared_is_current(cfg, backbone.tokenizer, backbone)  # not rows prepared from other data settings
    max_length = layout.max_length(cfg)  # heads.k fits it: checked with the config (check_k_fits)
    imported = None
    if cfg.heads.from_speculators:  # a drafter trained elsewhere: its weights and draft vocabulary
        from mtp_train.heads.persist import read_speculators_eagle3

        imported, draft_ids = read_speculators_eagle3(Path(cfg.heads.from_speculators), cfg.heads, backbone)
    else:
        draft_ids = draft_vocab_for(cfg, backbone)
    torch.manual_seed(cfg.seed)  # the heads' init must not depend on what preparation drew before
    heads = build_heads(cfg.heads, backbone, draft_ids=draft_ids)
    if imported is not None:
        from mtp_train.heads.persist import load_checked

        load_checked(heads, imported, Path(cfg.heads.from_speculators) / "model.safetensors", cfg.heads)
    if done is not None:
        from mtp_train.heads.persist import load_heads

        heads = load_heads(run_dir, backbone)[0].train()
    n = count_parameters(heads)
    lora = sum(p.numel() for p in backbone.model.parameters() if p.requires_grad)
    log.info("heads: %s, k=%d, %s trainable parameters (backbone %s, frozen%s)", cfg.heads.type,
             cfg.heads.k, f"{n['trainable']:,}", f"{sum(p.numel() for p in backbone.model.parameters()) - lora:,}",
             f"; LoRA adapters {lora:,}, trained with the heads" if lora else "")
    pad = backbone.tokenizer.pad_token_id
    cache = None
    if cfg.backbone.lora.enabled:
        if cfg.train.use_cache:
            log.info("backbone.lora.enabled: the backbone runs live (its adapters train, so its states change "
                     "every step); the hidden-state cache is not used")
    else:
        cache = open_cache(cfg, backbone)
    dm = MTPDataModule(data_dirs(cfg), pad if pad is not None else 0, cfg.train.batch_size,
                       max_length, cfg.train.num_workers, cfg.seed, cache=cache,
                       data_fraction=cfg.train.data_fraction, k=cfg.heads.k,
                       length_window=cfg.train.length_window, vocab_size=backbone.vocab_size)
    if state.supersede is not None:  # every check of this run passed (backbone, data, heads, cache, rows)
        dm.setup()
        apply_supersede(run_dir, state)
    if (cfg.heads.init == "final_state" and imported is None and done is None
            and not layout.last_checkpoint(run_dir).exists()):
        fit_fc_to_final_state(heads, dm, backbone)
    module = MTPHeadsModule(backbone, heads, cfg.loss, cfg.train, cfg.backbone.lora)
    ckpt_dir = run_dir / layout.CHECKPOINTS
    # always last.ckpt, the one a resume reads: with the version counter Lightning writes last-v1.ckpt
    # when it cannot match the file to its own record (a changed save interval, a moved run directory),
    # and a killed run's progress would be in a file no resume reads
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, enable_version_counter=False,
                           every_n_train_steps=max(1, cfg.trainer.get("val_check_interval") or 50))
    had_checkpoint = layout.last_checkpoint(run_dir).exists()
    import_only = imported is not None and cfg.trainer.get("max_steps") == 0
    choose_t0 = time.time()
    timed_compile = None  # train.compile's decision where resolve_precision timed it with the precision
    if import_only:  # heads trained elsewhere, validated once: nothing to budget or time
        budget, budget_record = None, {}
        precision, precision_record = trained_precision(cfg, {}), {"why": "imported heads, not trained here"}
    elif done is None:  # a finished run only validates once more: nothing to budget or time
        budget, budget_record = time_budget(cfg, backbone, dm, resuming=had_checkpoint)
        choose_t0 = time.time()
        precision, precision_record, timed_compile = resolve_precision(cfg, backbone, heads, dm, budget)
    else:
        budget, budget_record = None, {}
        precision, precision_record = trained_precision(cfg, done), {}
    loggers = make_loggers(cfg)
    for lg in loggers:  # the whole resolved config, so every run records its recipe
        lg.log_hyperparams(OmegaConf.to_container(OmegaConf.structured(cfg)))
    trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=[ckpt] + ([budget] if budget else []),
                          **trainer_plugins(cfg.trainer), **budget_trainer_kwargs(cfg, budget, had_checkpoint),
                          **({"precision": precision} if precision != str(cfg.trainer.get("precision")) else {}))
    last = layout.last_checkpoint(run_dir)  # a file, or a directory of ZeRO shards under DeepSpeed
    if done is not None:
        return record_tree_stats(run_dir, module, trainer, dm, done)
    compiled, compile_record = (False, {}) if import_only else resolve_compile(
        cfg, backbone, heads, dm, precision, budget, trainer.world_size, timed_compile)
    if compiled:  # in place: the module, its state dict and its checkpoints are what eager training has
        heads.compile(dynamic=True)
    if budget is not None and (chose_s := time.time() - choose_t0) > 1.0:
        # the timings above ran inside the training time: the budget counts them (as its own clock
        # starts with the first step)
        budget.seconds = max(0.0, budget.seconds - chose_s)
        budget_record = {**budget_record, "choices_s": round(chose_s, 1)}
    resuming = check_resume(run_dir, last, heads, backbone, cfg, recipe, write=trainer.is_global_zero,
                            precision=None if import_only else precision)
    from mtp_train.artifacts import read_json

    if len(used := (read_json(run_dir / layout.RUN_META) or {}).get("precisions") or []) > 1:
        # resumed in another precision: heads.json says every one the run trained in, not the last only
        log.warning("this run trained in %s, in that order (trainer.precision changed across a resume)",
                    " then ".join(used))
        precision_record = {**precision_record, "history": used}
    if trainer.is_global_zero:  # what export reads: no other command writes it (the lock)
        from mtp_train.artifacts import write_text_atomic

        write_text_atomic(run_dir / layout.RUN_CONFIG, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if not import_only:
        with resume_loads_weights_only(last if resuming else None) as extra, warnings.catch_warnings():
            # Lightning warns that a mid-epoch resume with a dataloader it cannot checkpoint is
            # unreliable; ours skips exactly the rows the run saw (lit/data.py ResumableSampler), and a
            # killed-and-resumed run ends with bit-identical heads (tests/test_train.py)
            warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable")
            trainer.fit(module, datamodule=dm, ckpt_path=str(last) if resuming else None, **extra)
        # last.ckpt holds the final weights, whatever step the last periodic save was at (an export
        # from it must give the heads written below, not older ones)
        # with the optimizer's and callbacks' states (a resume continues from it; saying so keeps
        # Lightning from logging that it defaulted to it)
        trainer.save_checkpoint(str(layout.last_checkpoint(run_dir)), weights_only=False)
    metrics = {k: float(v) for k, v in trainer.validate(module, datamodule=dm, verbose=False)[0].items()}
    with gathered(module, trainer):
        if trainer.is_global_zero:  # one writer; the other ranks return the same (reduced) metrics
            path = save_heads(run_dir, heads, backbone, cfg, metrics, trainer.world_size,
                              elapsed_s=round(time.time() - t0, 1),
                              recipe={"recipe": recipe, "finished": finished,
                                      # the split validation prompts come from (mtp-eval checks it)
                                      "labelled_hash": labelled_hash(cfg),
                                      "train_rows": len(dm.splits["train"]), "train_tokens": dm.train_tokens,
                                      "cache": str(cache.path) if cache is not None else None,
                                      "steps": trainer.global_step,
                                      "from_speculators": (imported_record(cfg.heads.from_speculators)
                                                           if imported is not None else None),
                                      "budget": ({**budget.summary(trainer.global_step), **budget_record}
                                                 if budget else None),
                                      "precision": {"used": str(trainer.precision), **precision_record},
                                      "compile": {"used": compiled, **compile_record}})
            module.rank_stats.save(run_dir / TREE_STATS)
    close_loggers(loggers)
    if trainer.is_global_zero:
        log.info("heads written to %s (val/sim_tau %.3f)", path, metrics.get("val/sim_tau", float("nan")))
        print(json.dumps({"heads": str(path), **{k: round(v, 4) for k, v in metrics.items()}}, indent=1))
    return metrics


def eval_trained(cfg: Config) -> dict | None:
    """train.eval_after: mtp-eval on the heads just written to paths.output_dir, into <run dir>/eval
    (rank 0 only; an evaluation already done for these heads and settings is kept)."""
    import dataclasses

    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from mtp_train.pipeline.evaluation import run_eval

    if rank_zero_only.rank != 0:
        return None
    run_dir = Path(cfg.paths.output_dir)
    return run_eval(dataclasses.replace(
        cfg, eval=dataclasses.replace(cfg.eval, train_run=str(run_dir)),
        paths=dataclasses.replace(cfg.paths, output_dir=str(run_dir / "eval"))))
