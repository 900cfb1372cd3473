"""The library behind `mtp-clp` (mtp_train/cli/clp.py): self-generated acceptance labels -> span-length predictors (clp, gate) -> a calibrated threshold."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from mtp_train import layout
from mtp_train.config import Config
from mtp_train.errors import ConfigError, MtpError

log = logging.getLogger(__name__)

STAGES = ("label", "fit", "calibrate", "all")


def _setup(cfg: Config):
    from mtp_train.backbone import eos_ids, load_backbone
    from mtp_train.decoding import Decoder
    from mtp_train.heads.persist import load_heads

    if not cfg.clp.train_run:
        raise ConfigError("clp.train_run: set it to an mtp-train run directory (heads.safetensors + heads.json)")
    backbone = load_backbone(cfg.backbone)
    heads, meta = load_heads(cfg.clp.train_run, backbone, cfg.backbone.allow_foreign_heads)
    if backbone.adapter:  # heads trained with LoRA adapters: label and calibrate on the adapted model
        from mtp_train.adapters import merge_adapters

        merge_adapters(backbone.model)
    return backbone, heads, Decoder(backbone, heads, eos_ids=eos_ids(backbone.model, backbone.tokenizer))


def distilled_cache(cfg: Config, backbone, split: str = "train", aux_layers: list[int] | None = None):
    """(rows of `split`, hidden-state cache, index of the first self-distilled row in them) when the
    training cache holds the backbone's own answers, else None. `aux_layers`: those the heads read
    (EAGLE-3), whose cache is another one."""
    from mtp_train.data.prepared import load_splits, open_cache
    from mtp_train.layout import data_dirs, distilled_dir

    dirs = data_dirs(cfg)
    if distilled_dir(cfg) not in dirs:
        return None
    cache = open_cache(cfg, backbone, aux_layers)
    if cache is None:
        return None
    sizes: list[dict] = []  # the rows load_splits reads of each (a stopped distillation trims the originals)
    rows = load_splits(dirs, sizes)[split]
    first = sum(n[split] for n in sizes[: dirs.index(distilled_dir(cfg))])
    return rows, cache, first


def stage_label(cfg: Config, backbone, heads, decoder, out: Path) -> dict:
    from mtp_train.artifacts import file_sha256
    from mtp_train.data.acceptance import labels_from_cache, make_labels
    from mtp_train.evaluation.prompts import held_out_prompts
    from mtp_train.layout import labelled_dir

    source = cfg.clp.label_source
    split = cfg.clp.label_split
    if backbone.adapter and source == "cache":
        raise ConfigError(f"clp.label_source: 'cache' holds the original backbone's states, but the heads of "
                          f"{cfg.clp.train_run} were trained with LoRA adapters and draft for the adapted one; "
                          "use clp.label_source=decode (or auto)")
    found = (distilled_cache(cfg, backbone, split, list(heads.aux_layers))
             if source in ("auto", "cache") else None)
    if source == "cache" and found is None:
        raise ConfigError("clp.label_source: 'cache' needs the hidden-state cache of self-distilled "
                          "data (train.data_use=distilled or mix, then `mtp-prep stage=cache`); or "
                          "set clp.label_source=decode")
    identity = {"backbone": backbone.name, "backbone_identity": backbone.identity,
                "heads_sha256": file_sha256(Path(cfg.clp.train_run) / layout.HEADS_FILE), "k": heads.k}
    if found is not None:
        rows, cache, first = found
        if len(rows) - first < 2:
            raise ConfigError(f"clp.label_split={split}: {len(rows) - first} self-distilled rows in that "
                              "split, too few to fit and check a predictor; distil more of it "
                              f"(data.distill.max_{'val' if split == 'validation' else 'train'}_prompts, "
                              "data.val_fraction) or use clp.label_source=decode")
        return labels_from_cache(rows, cache, split, first, heads, backbone, out / layout.LABELS,
                                 {**identity, "cache": cache.manifest.get("config_hash"), "split": split})
    prompts = [p for p in held_out_prompts(labelled_dir(cfg), "train")
               if len(p) + cfg.clp.max_new_tokens <= getattr(backbone.config, "max_position_embeddings", 10**9)]
    prompts = prompts[: cfg.clp.n_prompts]
    from mtp_train.decoding.plans import Chain

    return make_labels(prompts, decoder, out / layout.LABELS, cfg.clp.max_new_tokens, cfg.clp.shard_prompts,
                       identity, Chain())


def held_out_by_fit(prompt, val_fraction: float):
    """Which labels (by their prompt index) the predictor's fit holds out: whole prompts, not steps
    (steps of one answer correlate), every round(1 / val_fraction)-th prompt from the first."""
    return (prompt % max(2, round(1 / val_fraction))) == 0


def calibration_prompts(cfg: Config, backbone, labels_manifest: dict,
                        aux_layers: list[int] | None = None) -> list[list[int]]:
    """The prompts the threshold is calibrated on, none of whose answers the predictor was fitted on.

    Labels made from the cache's self-distilled validation rows: the prompts of the rows the fit held
    out. Otherwise (labels from the training split, by decoding or from the cache): the prepared
    validation prompts."""
    from mtp_train.evaluation.prompts import held_out_prompts, row_prompt
    from mtp_train.layout import labelled_dir

    n = cfg.clp.calib_prompts
    if labels_manifest.get("source") == "cache" and labels_manifest.get("split") == "validation":
        found = distilled_cache(cfg, backbone, "validation", aux_layers)
        if found is not None:
            rows, _, first = found
            held = (rows[first + p] for p in range(len(rows) - first) if held_out_by_fit(p, cfg.clp.val_fraction))
            out = [p for p in (row_prompt(r["input_ids"], r["labels"]) for r in held) if p]
            if len(out) < n:
                log.warning("calibrating on %d prompts (clp.calib_prompts=%d): only %d labelled "
                            "validation rows were held out of the fit", len(out), n, len(out))
            return out[:n]
    return held_out_prompts(labelled_dir(cfg))[:n]


def fit_key(cfg: Config, kind: str, labels_manifest: dict) -> str:
    """What a fitted predictor depends on: its labels (their manifest's hash) and fit settings."""
    from mtp_train.artifacts import config_hash

    c = cfg.clp
    return config_hash({"labels": labels_manifest.get("config_hash"), "kind": kind, "seed": cfg.seed,
                        "use_head_probs": c.use_head_probs, "epochs": c.epochs, "batch_size": c.batch_size,
                        "lr": c.lr, "val_fraction": c.val_fraction})


def calibration_key(cfg: Config, predictor_meta: dict, prompts: list[list[int]]) -> str:
    """What a calibrated threshold depends on: the fitted predictor, the prompts, thresholds, bounds and length."""
    from mtp_train.artifacts import config_hash

    c = cfg.clp
    return config_hash({"fit": predictor_meta.get("fit_hash"), "heads": predictor_meta.get("heads_sha256"),
                        "prompts": config_hash(prompts),
                        # decoded from the highest down when stopping at a failure: their order then changes nothing
                        "thresholds": sorted(c.thresholds) if c.stop_at_failure else list(c.thresholds),
                        "bounds": [c.max_repetition_increase, c.max_nll_increase], "bound_z": c.bound_z,
                        "stop_at_failure": c.stop_at_failure,
                        "max_new_tokens": cfg.eval.max_new_tokens})


def stage_fit(cfg: Config, backbone, heads, out: Path) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from mtp_train.artifacts import file_sha256, read_json, read_manifest
    from mtp_train.clp import (
        build_predictor,
        class_weights,
        held_out_calibration,
        save_predictor,
        undo_class_weights,
    )
    from mtp_train.data.acceptance import read_labels
    from mtp_train.heads.persist import count_parameters
    from mtp_train.layout import PREDICTOR_FILE, PREDICTOR_META
    from mtp_train.lit.predictor import SpanFitModule

    labels_dir = out / layout.LABELS
    manifest = read_manifest(labels_dir)
    if manifest is None:
        raise MtpError(f"{labels_dir}: no acceptance labels; run `mtp-clp stage=label` first")
    heads_hash = file_sha256(Path(cfg.clp.train_run) / layout.HEADS_FILE)
    if manifest.get("heads_sha256") != heads_hash or manifest.get("k") != heads.k:
        raise ConfigError(f"{labels_dir}: labels were made with another heads checkpoint; rerun "
                          "`mtp-clp stage=label` for clp.train_run")
    hidden, probs, labels, prompt = read_labels(labels_dir, heads.k, backbone.hidden_size)
    n_prompts = int(prompt.max()) + 1
    is_val = held_out_by_fit(prompt, cfg.clp.val_fraction)
    if is_val.all() or not is_val.any():
        raise MtpError(f"{labels_dir}: {n_prompts} labelled prompts are too few to hold out a validation set")
    weights = class_weights(labels[~is_val], heads.k)
    drop_stale_predictors(out, heads_hash, keep=list(cfg.clp.kinds))
    results = {}
    for kind in cfg.clp.kinds:
        key = fit_key(cfg, kind, manifest)
        old = read_json(out / kind / PREDICTOR_META)
        if not cfg.force and old is not None and old.get("fit_hash") == key and (out / kind / PREDICTOR_FILE).is_file() \
                and intact(old, out / kind / PREDICTOR_FILE):
            log.info("%s: fitted on these labels with these settings already; skipping", kind)
            results[kind] = {**old["fit"], "skipped": True}
            continue
        torch.manual_seed(cfg.seed)
        pred = build_predictor(kind, backbone.hidden_size, heads.k, cfg.clp.use_head_probs)
        module = SpanFitModule(pred, weights, cfg.clp.lr)

        def loader(mask, shuffle):
            return DataLoader(TensorDataset(hidden[mask], probs[mask], labels[mask]),
                              batch_size=cfg.clp.batch_size, shuffle=shuffle)

        trainer = L.Trainer(max_epochs=cfg.clp.epochs, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(module, loader(~is_val, True), loader(is_val, False))
        val = {k: float(v) for k, v in trainer.validate(module, loader(is_val, False), verbose=False)[0].items()}
        # the weights rebalance what the fit attends to; the decision rule needs the label frequencies
        undo_class_weights(pred, weights)
        val.update(held_out_calibration(pred, hidden[is_val], probs[is_val], labels[is_val]))
        meta = {"backbone": backbone.name, "heads_sha256": heads_hash, "threshold": 1.0, "calibrated": False,
                "fit_hash": key, "class_weights_undone": True,
                "label_histogram": manifest["label_histogram"], "class_weights": weights.tolist(),
                "fit": val}
        save_predictor(out / kind, pred, meta)
        log.info("%s: %s parameters, validation accuracy %.3f (majority class %.3f); P(L >= 1) "
                 "predicted %.3f, observed %.3f", kind, f"{count_parameters(pred)['total']:,}", val["val/acc"],
                 float((labels[is_val] == 0).float().mean()), val["val/p_span1_predicted"],
                 val["val/p_span1_observed"])
        results[kind] = val
    return results


def drop_stale_predictors(out: Path, heads_hash: str, keep: list[str]) -> list[str]:
    """Predictors this fit does not refit (kinds outside clp.kinds) that were fitted on other heads'
    acceptance are removed (their predictor.json and predictor.safetensors, the files mtp-clp wrote),
    so the directory never offers a predictor of earlier heads beside these heads' ones."""
    from mtp_train.artifacts import read_json
    from mtp_train.choices import PREDICTOR_KINDS
    from mtp_train.layout import PREDICTOR_FILE, PREDICTOR_META

    dropped = []
    for kind in PREDICTOR_KINDS:
        if kind in keep:
            continue
        meta = read_json(out / kind / PREDICTOR_META)
        # only a predictor that says it was fitted on other heads: one without the digest is kept,
        # as mtp-eval keeps it, and a file that is not mtp-clp's record is not touched
        if not isinstance(meta, dict) or meta.get("heads_sha256") in (None, heads_hash):
            continue
        for name in (PREDICTOR_META, PREDICTOR_FILE):
            (out / kind / name).unlink(missing_ok=True)
        try:
            (out / kind).rmdir()  # only when nothing else is there
        except OSError:
            pass
        log.warning("%s: removed the %s predictor fitted on other heads (clp.kinds=%s does not refit it)",
                    out / kind, kind, keep)
        dropped.append(kind)
    return dropped


def passes(check, then: str) -> bool:
    """Whether a record is still as mtp-clp wrote it (`check` raises MtpError when not: then the
    step is done again, with a warning saying why)."""
    try:
        check()
        return True
    except MtpError as e:
        log.warning("%s; %s again", e, then)
        return False


def intact(meta: dict, weights: Path) -> bool:
    from mtp_train.clp import check_predictor_weights

    return passes(lambda: check_predictor_weights(meta, weights), "fitting")


def sealed(meta: dict, where: Path) -> bool:
    from mtp_train.clp import saved_threshold

    return passes(lambda: saved_threshold(meta, where), "calibrating")


def stage_calibrate(cfg: Config, backbone, heads, decoder, out: Path) -> dict:
    from mtp_train.artifacts import file_sha256, read_manifest, write_json_atomic
    from mtp_train.clp import calibration_seal, load_predictor
    from mtp_train.evaluation.calibration import (
        measure_decode,
        pick_threshold,
        sweep_thresholds,
    )
    from mtp_train.layout import PREDICTOR_META

    e = cfg.eval
    prompts = calibration_prompts(cfg, backbone, read_manifest(out / layout.LABELS) or {},
                                  list(heads.aux_layers))
    if not prompts:
        raise MtpError(f"{out / layout.LABELS}: no prompt to calibrate on (none of the labelled rows was held "
                       "out of the fit); raise clp.val_fraction or distil more validation prompts")
    results, todo, room = {}, [], None
    heads_hash = file_sha256(Path(cfg.clp.train_run) / layout.HEADS_FILE)
    for kind in cfg.clp.kinds:
        pred, meta = load_predictor(out / kind, backbone.hidden_size, heads.k, backbone.name, kind)
        if meta.get("heads_sha256") != heads_hash:
            raise ConfigError(f"{out / kind}: fitted on the labels of other heads than clp.train_run="
                              f"{cfg.clp.train_run}; rerun `mtp-clp stage=all` (label and fit) for these heads")
        key = calibration_key(cfg, meta, prompts)
        if not cfg.force and meta.get("calibration_hash") == key and sealed(meta, out / kind / PREDICTOR_META):
            log.info("%s: calibrated for this predictor and these settings already (threshold %.2f); skipping",
                     kind, meta["threshold"])
            results[kind] = {"threshold": meta["threshold"], "skipped": True}
        else:
            todo.append((kind, pred, meta, key))
    if todo and cfg.budget.deadline is not None:
        chosen, why, room = deadline_kinds(cfg, backbone, prompts, [t[0] for t in todo])
        for kind, _, meta, _ in [t for t in todo if t[0] not in chosen]:
            if meta.get("calibrated") or "calibration" in meta:  # calibrated for other settings: not for these
                for key in ("calibration", "calibration_hash", "bounds"):
                    meta.pop(key, None)
                meta.update(threshold=1.0, calibrated=False)
                meta["seal"] = calibration_seal(meta)
            meta["not_calibrated"] = why[kind]  # for the report (outside the seal: it decides nothing)
            write_json_atomic(out / kind / PREDICTOR_META, meta)
            log.warning("budget.deadline: %s not calibrated (threshold 1.0: commits no draft unverified): %s", kind,
                        why[kind])
            results[kind] = {"threshold": 1.0, "skipped": True, "not_calibrated": why[kind]}
        todo = [t for t in todo if t[0] in chosen]
    if not todo:
        return results
    reference = measure_decode(decoder, prompts, e.max_new_tokens, "greedy")  # shared by every kind
    c = cfg.clp
    bounds = (c.max_repetition_increase, c.max_nll_increase, c.bound_z)
    for i, (kind, pred, meta, key) in enumerate(todo):
        # the next threshold, and the first of each kind after this one, must leave the evaluation its modes
        passes = sweep_rule(bounds, room, len(prompts) * (len(todo) - i)) if c.stop_at_failure else None
        greedy, rows = sweep_thresholds(decoder, pred, prompts, list(c.thresholds), e.max_new_tokens,
                                        greedy=reference, passes=passes)
        best = pick_threshold(rows, greedy, *bounds)
        for row in rows:
            log.info("%s: threshold %.2f: tau %.2f, NLL %+.3f (+ %g SE: %+.3f), repetition %+.3f (%+.3f) over "
                     "greedy on %d prompts: %s", kind, row["threshold"], row["tau"], row["nll_increase"], c.bound_z,
                     row["nll_increase_upper"], row["repetition_increase"], row["repetition_increase_upper"],
                     len(prompts), "within the bounds" if row["within_bounds"] else "outside the bounds")
            if row.get("stopped_after") and row.get("stopped_by_deadline"):
                log.info("%s: thresholds %s not decoded: budget.deadline leaves no time for them", kind,
                         row["stopped_after"])
            elif row.get("stopped_after"):
                log.info("%s: thresholds %s not decoded: they commit more drafts than %.2f, which failed", kind,
                         row["stopped_after"], row["threshold"])
        if best is None:
            log.warning("%s: no threshold in %s keeps repetition within greedy + %.2f and NLL within greedy "
                        "+ %.2f nats (paired mean + %g standard errors over %d prompts); keeping threshold = 1.0 "
                        "(accept no draft)", kind, list(c.thresholds), c.max_repetition_increase,
                        c.max_nll_increase, c.bound_z, len(prompts))
        meta.pop("not_calibrated", None)
        meta.update(threshold=best["threshold"] if best else 1.0, calibrated=best is not None,
                    calibration_hash=reusable_key(key, rows),
                    bounds={"max_repetition_increase": c.max_repetition_increase,
                            "max_nll_increase": c.max_nll_increase, "bound_z": c.bound_z},
                    calibration={"greedy": greedy, "thresholds": rows, "n_prompts": len(prompts)})
        meta["seal"] = calibration_seal(meta)
        write_json_atomic(out / kind / PREDICTOR_META, meta)
        results[kind] = {"threshold": meta["threshold"], "skipped": False}
        log.info("%s: threshold = %.2f%s", kind, meta["threshold"], "" if best else " (no threshold met the bounds)")
    return results


def reusable_key(key: str, rows: list[dict]) -> str | None:
    """The calibration key a finished sweep is saved under, for a rerun with the same settings to
    skip it; None where the deadline stopped it before thresholds it would have decoded (a rerun with
    more time decodes them)."""
    return None if any(r.get("stopped_by_deadline") and r.get("stopped_after") for r in rows) else key


def sweep_rule(bounds: tuple[float, float, float], room=None, next_decodes: int = 0):
    """The calibration sweep's `passes(row, greedy)` (clp.stop_at_failure): the row is within the
    bounds (`judge`, with bounds = (max repetition increase, max NLL increase, z)), and, under a
    deadline, `room(next_decodes)` says the next threshold's decodes still leave the evaluation its
    modes (`budget.calibration_room`); a row stopped by the deadline alone is marked
    `stopped_by_deadline` and stays a candidate."""
    from mtp_train.evaluation.calibration import judge

    def passes(row: dict, greedy: dict) -> bool:
        if not judge(row, greedy, *bounds):
            return False
        if room is not None and not room(next_decodes):
            row["stopped_by_deadline"] = True
            return False
        return True
    return passes


def deadline_kinds(cfg: Config, backbone, prompts: list[list[int]], pending: list[str]):
    """budget.deadline: which of the `pending` predictors are worth calibrating before it
    (budget.kinds_to_calibrate), why each other one is not, and `budget.calibration_room` at the same
    prices, which the sweep asks before each threshold after the first. The evaluation is priced as mtp-eval will price it, on the median of
    the prompts it decodes (the calibration `prompts` where those cannot be read here), and the
    calibration on the median of its own `prompts`: at the rate mtp-train measured for this pipeline
    (heads.json), its prefill scaled to each prompt's length (`Rate.for_prompt`), where that was on
    this CPU, in the dtype calibration decodes in and with the probe's length recorded; else
    measured here on the evaluation's prompt."""
    from mtp_train.artifacts import read_json
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.evaluation.prompts import typical_prompt as median
    from mtp_train.pipeline.budget import (
        Rate,
        calibration_room,
        check_deadline,
        decode_rate,
        kinds_to_calibrate,
    )
    from mtp_train.pipeline.evaluation import select_prompts

    check_deadline(cfg.budget.deadline)
    try:
        typical = median(select_prompts(cfg, backbone)[0])
    except Exception as e:  # noqa: BLE001 (a price only: mtp-clp goes on without the evaluation's prompts)
        log.warning("budget.deadline: the evaluation's prompts could not be read here (%s); its decodes are "
                    "priced on the calibration prompts", e)
        typical = median(prompts)
    meta = read_json(Path(cfg.clp.train_run) / layout.HEADS_META) or {}
    record = ((meta.get("recipe") or {}).get("budget") or {})
    probe = record.get("after_train") or {}
    here = record.get("cpu") == cpu_model() and record.get("dtype") == str(backbone.model.dtype).replace("torch.", "")
    if here and probe.get("token_s") and probe.get("prefill_s") and probe.get("prompt_tokens"):
        rate = Rate(float(probe["prefill_s"]), float(probe["token_s"]), int(probe["prompt_tokens"])).for_prompt(len(typical))
    else:
        rate = decode_rate(backbone, typical, backbone.model.dtype)
    calibration_rate = rate.for_prompt(len(median(prompts)))
    chosen, why = kinds_to_calibrate(cfg, rate, cfg.budget.deadline - time.time() - 60 * cfg.budget.margin_min,
                                     pending, calibration_rate=calibration_rate)
    return chosen, why, calibration_room(cfg, rate, calibration_rate)


def run_clp(cfg: Config) -> dict:
    from mtp_train.runlock import run_lock

    if cfg.stage not in STAGES:
        raise ConfigError(f"stage: mtp-clp has stages {', '.join(STAGES)}, got {cfg.stage!r}")
    with run_lock(Path(cfg.paths.output_dir), "mtp-clp"):
        return _run_clp(cfg)


def _run_clp(cfg: Config) -> dict:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from mtp_train.artifacts import read_json, write_json_atomic

    backbone, heads, decoder = _setup(cfg)
    results = {}
    times = read_json(out / layout.STAGE_TIMES) or {}
    for stage, fn in (("label", lambda: stage_label(cfg, backbone, heads, decoder, out)),
                      ("fit", lambda: stage_fit(cfg, backbone, heads, out)),
                      ("calibrate", lambda: stage_calibrate(cfg, backbone, heads, decoder, out))):
        if cfg.stage in (stage, "all"):
            t0 = time.time()
            before = read_json(out / layout.LABELS / layout.MANIFEST)
            results[stage] = fn()
            skipped = (before is not None and before == results[stage] if stage == "label" else
                       all(r.get("skipped") for r in results[stage].values()))
            if not skipped:  # wall seconds of each stage's last run that did work
                times[stage] = round(time.time() - t0, 1)
                write_json_atomic(out / layout.STAGE_TIMES, times)
    _to_wandb(cfg, results, out)
    return results


def _to_wandb(cfg: Config, results: dict, out: Path) -> None:
    """With logger=wandb: the predictors' fit metrics and chosen thresholds, as a `clp` job."""
    from mtp_train.tracking import wandb_init

    run = wandb_init(cfg, "clp", out, config={"clp": dict(vars(cfg.clp))})
    if run is None:
        return
    run.log({f"clp/{kind}/{key}": value for stage in ("fit", "calibrate")
             for kind, r in (results.get(stage) or {}).items() for key, value in r.items()
             if isinstance(value, (int, float)) and not isinstance(value, bool)})
    run.finish()
