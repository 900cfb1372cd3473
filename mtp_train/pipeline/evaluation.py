"""The library behind `mtp-eval` (mtp_train/cli/eval.py): what trained heads buy when decoding, against HF generate greedy on the same prompts."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from omegaconf import OmegaConf

from mtp_train import layout
from mtp_train.config import Config
from mtp_train.errors import ConfigError, MtpError

log = logging.getLogger(__name__)


def check_held_out_split(cfg: Config, meta: dict) -> None:
    """eval.prompt_source=validation decodes the labelled data's validation prompts: they are held
    out only if that data is the split the heads trained on (heads.json records its hash; heads
    from before that record are not checked). A re-split dataset would hand the heads prompts
    they trained on."""
    from mtp_train.artifacts import read_manifest
    from mtp_train.layout import labelled_dir

    trained_on = (meta.get("recipe") or {}).get("labelled_hash")
    here = (read_manifest(labelled_dir(cfg)) or {}).get("config_hash")
    if trained_on and here != trained_on:
        raise ConfigError(f"eval.prompt_source: {labelled_dir(cfg)} is not the split these heads trained on "
                          f"(prepared {str(here)[:12]}, the heads' {trained_on[:12]}: other data settings, or "
                          "re-prepared since), so its validation prompts may be training prompts; prepare it "
                          "with the heads' data settings or use eval.prompt_source=unseen")


def select_prompts(cfg: Config, backbone) -> tuple[list[list[int]], int]:
    """The prompts to decode and how many were skipped as too long for eval.max_prompt_tokens or
    the backbone's context (prompt + max_new_tokens)."""
    from mtp_train.evaluation.prompts import held_out_prompts, load_prompts_jsonl
    from mtp_train.layout import labelled_dir

    e = cfg.eval
    if e.prompts:
        prompts = load_prompts_jsonl(Path(e.prompts), backbone.tokenizer)
    elif e.prompt_source == "unseen":
        prompts = unseen_prompts(cfg, backbone.tokenizer)
    else:
        prompts = held_out_prompts(labelled_dir(cfg))
    context = getattr(backbone.config, "max_position_embeddings", None) or 10**9
    if e.max_new_tokens >= context:
        raise ConfigError(f"eval.max_new_tokens: {e.max_new_tokens} new tokens do not fit the backbone's "
                          f"context of {context} tokens with any prompt; ask for fewer")
    lazy = not e.prompts and e.prompt_source == "unseen"  # rendered one by one: stop at n_prompts
    keep, skipped, shortest = [], 0, None
    for p in prompts:  # (unseen prompts come one by one: the lengths are seen here only)
        shortest = len(p) if shortest is None else min(shortest, len(p))
        if len(p) <= e.max_prompt_tokens and len(p) + e.max_new_tokens <= context:
            keep.append(p)
            if lazy and e.n_prompts and len(keep) == e.n_prompts:
                break
        else:
            skipped += 1
    if skipped:
        log.warning("%d prompt(s) longer than eval.max_prompt_tokens=%d or the context (%d) skipped",
                    skipped, e.max_prompt_tokens, context)
    if not keep:
        shortest = shortest or 0
        where = f"eval.prompts={e.prompts}" if e.prompts else f"the {e.prompt_source} prompts"
        if shortest >= context:  # the prompts alone fill the context: no token budget helps
            raise ConfigError(f"{'eval.prompts' if e.prompts else 'eval.prompt_source'}: every prompt of "
                              f"{where} is as long as the backbone's context of {context} tokens or longer "
                              f"(the shortest has {shortest}); use shorter prompts")
        if shortest <= e.max_prompt_tokens:  # the context, not the prompt cap, ruled them all out
            raise ConfigError(f"eval.max_new_tokens: the shortest prompt ({shortest} tokens) + "
                              f"{e.max_new_tokens} new tokens exceed the backbone's context of {context}")
        raise ConfigError(f"eval.max_prompt_tokens: every prompt is longer than {e.max_prompt_tokens} tokens "
                          f"(the shortest has {shortest})")
    return keep[: e.n_prompts] if e.n_prompts else keep, skipped


def unseen_prompts(cfg: Config, tokenizer):
    """eval.prompt_source=unseen: the conversations of the configured data source (read as the data
    stage reads them) whose id is in neither split of the prepared labelled dataset, shuffled by
    cfg.seed, each rendered up to its first assistant turn; a lazy iterator, the caller stops early."""
    from mtp_train.data.prepared import check_labelled_is_current
    from mtp_train.data.sources import SourceStats, read_conversations
    from mtp_train.evaluation.prompts import dataset_ids, render_prompts, unseen_conversations
    from mtp_train.layout import labelled_dir

    check_labelled_is_current(cfg, tokenizer)  # the ids must come from this source's dataset
    seen = dataset_ids(labelled_dir(cfg))
    convs = read_conversations(cfg.data, SourceStats(), keep_prompt_only=cfg.data.distill.enabled)
    unseen = unseen_conversations(convs, seen, cfg.seed)
    if not unseen:
        raise ConfigError(f"eval.prompt_source: there are no unseen conversations in data.source="
                          f"{cfg.data.source}: the data stage used all {len(convs)} of them "
                          "(lower data.max_conversations, or use eval.prompt_source=validation)")
    log.info("eval.prompt_source=unseen: %d of the source's %d conversations are not in %s",
             len(unseen), len(convs), labelled_dir(cfg))
    return render_prompts(unseen, tokenizer)


def predictor_threshold(meta: dict, path) -> float:
    """A predictor's calibrated threshold (`clp.saved_threshold`), refused when its predictor.json has none."""
    from mtp_train.clp import saved_threshold

    value = saved_threshold(meta, path)
    if value is None:
        raise MtpError(f"{path}: predictor.json holds no threshold; rerun `mtp-clp stage=calibrate`")
    return value


def load_span_policies(cfg: Config, backbone, heads) -> dict:
    """mode -> SpanPolicy for the modes that need a span predictor (from eval.clp_run, the mtp-clp
    run), at its calibrated threshold."""
    from mtp_train.artifacts import file_sha256
    from mtp_train.clp import SpanPolicy, load_predictor
    from mtp_train.evaluation.modes import MODES
    from mtp_train.heads.persist import count_parameters
    from mtp_train.layout import HEADS_FILE

    out, loaded, heads_hash = {}, {}, None
    for mode in cfg.eval.modes:
        kind = MODES[mode].predictor  # the predictor kind the mode needs, in the mtp-clp run's <kind>/
        if kind is None:
            continue
        path = layout.predictor_dir(cfg.eval.clp_run, kind)
        if kind not in loaded:  # clp and clp+verify read the same predictor: once
            loaded[kind] = load_predictor(Path(path), backbone.hidden_size, heads.k, backbone.name, kind)
        pred, meta = loaded[kind]
        heads_hash = heads_hash or file_sha256(Path(cfg.eval.train_run) / HEADS_FILE)
        if meta.get("heads_sha256") not in (None, heads_hash):
            raise ConfigError(f"eval.clp_run: {path} was fitted on the acceptance of other heads than eval.train_run="
                              f"{cfg.eval.train_run}; fit one for these heads (`mtp-clp clp.train_run={cfg.eval.train_run}`)")
        threshold = predictor_threshold(meta, path)
        if cfg.eval.span_threshold is not None:
            calibrated_at, threshold = threshold, cfg.eval.span_threshold
            log.warning("%s: %s at eval.span_threshold = %.2f, not its calibrated threshold %.2f", path, mode,
                        threshold, calibrated_at)
        elif not meta.get("calibrated"):
            log.warning("%s: not calibrated (threshold %.2f); run `mtp-clp stage=calibrate`", path, threshold)
        policy = SpanPolicy(pred, threshold)
        policy.parameters = count_parameters(pred)["total"]
        policy.calibrated = bool(meta.get("calibrated"))
        out[mode] = policy
    return out


def adapted_backbone(backbone, prompts: list[list[int]], cfg: Config) -> dict | None:
    """With heads trained jointly with LoRA adapters (load_heads gave the backbone their adapters):
    the backbone's drift from the original on these prompts, measured first; then the adapters are
    merged into the weights, so decoding and HF generate both run the adapted model at full speed.
    None when the backbone carries no adapters."""
    from mtp_train.adapters import has_adapters, merge_adapters
    from mtp_train.backbone import eos_ids
    from mtp_train.evaluation.runner import backbone_drift

    if not backbone.adapter or not has_adapters(backbone.model):  # none, or backbone.lora's untrained zeros
        return None
    log.info("the heads were trained with LoRA adapters: decoding verifies against the adapted backbone; "
             "measuring its drift from the original first (greedy answers of both, untimed)")
    drift = backbone_drift(backbone, prompts, eos_ids(backbone.model, backbone.tokenizer), cfg.eval.max_new_tokens)
    merged = merge_adapters(backbone.model)
    log.info("drift: greedy answers identical %.2f, prefix kept %.2f, the original's NLL +%.3f on the adapted "
             "answers; %d adapters merged into the weights", drift["greedy_match_rate"], drift["prefix_match"],
             drift["nll_increase"], merged)
    return {"adapter": backbone.adapter, "merged_layers": merged, "drift": drift}


def load_tree_stats(cfg: Config, k: int | None = None):
    """The heads' rank statistics (tree_stats.json, written by mtp-train), which static trees and the
    adaptive policies grow from; required by mode tree. Statistics of another depth than the heads'
    `k` are refused (a file copied from other heads would grow wrong trees)."""
    from mtp_train.evaluation.modes import MODES
    from mtp_train.layout import TREE_STATS
    from mtp_train.trees import RankStats

    stats = RankStats.load(Path(cfg.eval.train_run) / TREE_STATS) if cfg.eval.train_run else None
    if stats is not None and k is not None and stats.k != k:
        raise MtpError(f"{Path(cfg.eval.train_run) / TREE_STATS}: rank statistics of k={stats.k} heads, but these "
                       f"heads have k={k}; it belongs to other heads: run the same mtp-train command on "
                       "this run directory to record its own (delete the file first)")
    needing = [m for m in cfg.eval.modes if MODES[m].tree_stats]
    if stats is None and needing:
        raise ConfigError(f"eval.modes: mode {needing[0]} grows its tree from {Path(cfg.eval.train_run) / TREE_STATS}, "
                          "which these heads lack; run the same mtp-train "
                          "command on that run directory once to record it (validation only)")
    return stats


def eval_key(cfg: Config) -> str:
    """What an evaluation depends on: every eval setting, the backbone, the prompts' source and the
    exact weights of the heads and predictors (and the predictors' calibrated thresholds)."""
    from mtp_train.adapters import WEIGHTS_FILE
    from mtp_train.artifacts import config_hash, file_sha256, read_manifest
    from mtp_train.backbone import backbone_identity
    from mtp_train.choices import PREDICTOR_KINDS
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.layout import (
        HEADS_FILE,
        PREDICTOR_FILE,
        PREDICTOR_META,
        TREE_STATS,
        labelled_dir,
    )

    def sha(path) -> str | None:
        return file_sha256(path) if path and Path(path).is_file() else None

    e = OmegaConf.to_container(OmegaConf.structured(cfg.eval))
    adapter = sha(Path(cfg.eval.train_run) / layout.ADAPTER_DIR / WEIGHTS_FILE) if cfg.eval.train_run else None
    run = cfg.eval.clp_run
    predictors = None if not run else {
        kind: [sha(layout.predictor_dir(run, kind) / f) for f in (PREDICTOR_FILE, PREDICTOR_META)]
        for kind in PREDICTOR_KINDS}
    prompts = sha(cfg.eval.prompts) if cfg.eval.prompts else \
        (read_manifest(labelled_dir(cfg)) or {}).get("config_hash")
    if not cfg.eval.prompts and cfg.eval.prompt_source == "unseen":
        # which conversations are left depends on the source file as well as the dataset taken from it
        from mtp_train.data.sources import source_identity

        prompts = {"dataset": prompts, "source": source_identity(cfg.data), "seed": cfg.seed,
                   "keep_prompt_only": cfg.data.distill.enabled}
    return config_hash({
        "eval": e, "backbone": backbone_identity(cfg.backbone),
        "prompt_source": "file" if cfg.eval.prompts else cfg.eval.prompt_source, "prompts": prompts,
        "heads": sha(Path(cfg.eval.train_run) / HEADS_FILE) if cfg.eval.train_run else None,
        "tree_stats": sha(Path(cfg.eval.train_run) / TREE_STATS) if cfg.eval.train_run else None,
        **({"adapter": adapter} if adapter else {}),  # heads trained with LoRA adapters
        "machine": cpu_model(),
        # sized to a deadline (whatever its time): not the same evaluation as one without
        **({"sized_to_deadline": True} if cfg.budget.deadline is not None else {}),
        "predictors": predictors})


def finished_eval(cfg: Config, out_dir: Path, key: str) -> dict | None:
    """The report of an evaluation this run directory already holds for exactly these inputs."""
    from mtp_train.artifacts import read_json

    report = read_json(out_dir / layout.EVAL_REPORT)
    if cfg.force or not isinstance(report, dict) or report.get("config_hash") != key:
        return None
    return report if (out_dir / layout.OUTPUTS).is_file() else None


def run_eval(cfg: Config) -> dict:
    from mtp_train.runlock import run_lock

    with run_lock(Path(cfg.paths.output_dir), "mtp-eval"):
        return _run_eval(cfg)


def drop_uncalibrated(cfg: Config, policies: dict) -> tuple[Config, list[str]]:
    """Under budget.deadline: cfg without the modes whose span predictor is not calibrated (mtp-clp
    found no threshold within the quality bounds and saved 1.0, which commits no draft beyond what
    verification would, or its own deadline sizing left it uncalibrated), and what was dropped. Their decodes would be greedy's plus the predictor's
    cost, minutes the sampled runs can use; the report still lists the predictor (`policies` is only read).
    A threshold given by hand (eval.span_threshold) is decoded, and the last mode is never dropped."""
    import dataclasses

    if cfg.eval.span_threshold is not None:
        return cfg, []
    drop = [m for m in cfg.eval.modes if m in policies and not policies[m].calibrated]
    keep = [m for m in cfg.eval.modes if m not in drop]
    if not drop or not keep:
        return cfg, []
    sampling = cfg.eval.sampling
    if sampling.modes is not None:  # None is "every mode that can sample": an emptied list samples none
        left = [m for m in sampling.modes if m in keep]
        sampling = dataclasses.replace(sampling, modes=left or None,
                                       temperatures=sampling.temperatures if left else
                                       [t for t in sampling.temperatures if t == 0])
    log.warning("budget.deadline: modes %s not decoded: their span predictor is not calibrated (no threshold met "
                "the quality bounds, or mtp-clp's deadline left no time to calibrate it), so they would decode as "
                "greedy does", drop)
    return (dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, modes=keep, sampling=sampling)),
            [f"modes {drop} (span predictor not calibrated: would decode as greedy)"])


def size_to_deadline(cfg: Config, backbone, prompt: list[int], asked: Config | None = None) -> tuple[Config, dict]:
    """budget.deadline: eval.* cut to what HF generate's measured rate says fits before it
    (mtp_train/pipeline/budget.py: sampled runs, then extra modes, then shorter decodes). `asked`: the
    configuration before anything was dropped (drop_uncalibrated), priced for the record as asked."""
    import time

    from mtp_train.pipeline.budget import (
        check_deadline,
        decode_rate,
        eval_seconds,
        greedy_overrun_s,
        size_eval,
    )

    check_deadline(cfg.budget.deadline)
    rate = decode_rate(backbone, prompt, backbone.model.dtype)
    left = cfg.budget.deadline - time.time() - 60 * cfg.budget.margin_min
    full = eval_seconds(cfg, rate)
    as_asked = full if asked is None else eval_seconds(asked, rate)
    asked_tokens = (asked or cfg).eval.max_new_tokens
    cfg, cuts = size_eval(cfg, rate, left, defer_sampled=True)
    record = {"left_s": round(left, 1), "token_s": round(rate.token_s, 5), "prefill_s": round(rate.prefill_s, 4),
              "predicted_full_s": round(as_asked, 1), "predicted_s": round(eval_seconds(cfg, rate), 1), "cut": cuts}
    if not cuts and full > left:
        record["sampled_deferred"] = True
    # the decodes shortened, or already at their floor and still over (the sampled runs, decided later
    # from the greedy decodes' measured time, do not count): the probes' rounds are minutes too
    record["shortened"] = cfg.eval.max_new_tokens < asked_tokens or greedy_overrun_s(cfg, rate, left) > 0
    if cuts:
        log.warning("budget.deadline: %.1f min left, the evaluation as asked is predicted to take %.1f; cut: %s",
                    left / 60, as_asked / 60, "; ".join(cuts))
    elif full > left:
        log.info("budget.deadline: %.1f min left, the evaluation as asked is predicted to take %.1f; its greedy part "
                 "fits, and its measured time decides the sampled runs", left / 60, as_asked / 60)
    else:
        log.info("budget.deadline: %.1f min left, the evaluation is predicted to take %.1f", left / 60, full / 60)
    return cfg, record


def _run_eval(cfg: Config) -> dict:
    import time

    from mtp_train.artifacts import write_json_atomic
    from mtp_train.backbone import load_backbone
    from mtp_train.evaluation.machine import hf_dtype_probe, machine, resolve_dtype
    from mtp_train.evaluation.prompts import typical_prompt
    from mtp_train.evaluation.render import print_table, save_report, write_plots
    from mtp_train.evaluation.runner import run_modes
    from mtp_train.heads.persist import load_heads

    t0 = time.time()
    cfg.eval.check_inputs()
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = eval_key(cfg)
    if (done := finished_eval(cfg, out_dir, key)) is not None:
        log.info("%s already holds this evaluation (same heads, predictors, prompts and settings); "
                 "skipping (force=true measures again)", out_dir)
        print_table(done)
        return done
    backbone = load_backbone(cfg.backbone)
    heads, meta = (load_heads(cfg.eval.train_run, backbone, cfg.backbone.allow_foreign_heads) if cfg.eval.train_run
                   else (None, {}))
    stats = load_tree_stats(cfg, heads.k if heads is not None else None)
    if heads is not None and not cfg.eval.prompts and cfg.eval.prompt_source == "validation":
        check_held_out_split(cfg, meta)
    dtype = resolve_dtype(cfg.eval.dtype)
    if dtype != backbone.model.dtype:
        backbone.model.to(dtype)
        if heads is not None:
            heads.to(dtype)
    log.info("decoding (and HF generate) in %s (eval.dtype=%s)", dtype, cfg.eval.dtype)
    prompts, skipped = select_prompts(cfg, backbone)
    sized = None
    policies = load_span_policies(cfg, backbone, heads)
    if cfg.budget.deadline is not None and prompts:
        asked = cfg
        cfg, dropped = drop_uncalibrated(cfg, policies)
        cfg, sized = size_to_deadline(cfg, backbone, typical_prompt(prompts), asked)
        sized["cut"] = [*dropped, *sized["cut"]]
    adapted = adapted_backbone(backbone, prompts, cfg) if heads is not None else None
    log.info("decoding %d prompts x %d modes + HF generate, %d new tokens each, %d timing round(s)",
             len(prompts), len(cfg.eval.modes), cfg.eval.max_new_tokens, cfg.eval.rounds)
    sim_tau = (meta.get("metrics") or {}).get("val/sim_tau")
    deadline = None if sized is None else cfg.budget.deadline - 60 * cfg.budget.margin_min
    shortened = sized is not None and sized["shortened"]
    report, outputs = run_modes(backbone, heads, prompts, cfg.eval, span_policies=policies, sim_tau=sim_tau,
                                tree_stats=stats, deadline=deadline, quick_probes=shortened)
    if sized is not None and (fit := report.pop("sampled_fit", None)) is not None:
        sized["sampled_fit"] = fit
        if fit["cut"]:
            sized["cut"] = [*sized["cut"], f"sampled runs at T={fit['cut']} (each predicted "
                            f"{fit['per_temperature_s'] / 60:.1f} min from the greedy decodes, and "
                            f"{fit['tail_s'] / 60:.1f} min after them, for {fit['left_s'] / 60:.1f} min left)"]
    # the training's predictions of the sampled chain's tau, per temperature (val/sim_tau_t0.7, ...)
    report["sim_tau_sampled"] = {m[1]: v for key, v in (meta.get("metrics") or {}).items()
                                 if (m := re.fullmatch(r"val/sim_tau_t(\d+\.\d+)", key))}
    report["machine"] = machine()
    log.info("HF generate in float32 and bfloat16 on a few prompts (for the speedup against the faster)")
    report["hf_dtypes"] = hf_dtype_probe(backbone, prompts, report["eos"], max_new_tokens=32)
    here = str(backbone.model.dtype).replace("torch.", "")
    best = max(report["hf_dtypes"].values())
    for m in report["modes"].values():  # same-dtype speedup x (this dtype's HF / the faster HF)
        m["speedup_vs_best_hf"] = m["speedup_vs_hf"] * report["hf_dtypes"][here] / best if best else None
    if adapted:
        report["backbone_adapted"] = adapted
    if sized is not None:
        report["sized_to_deadline"] = sized
    report["predictors"] = {m: {"parameters": p.parameters, "threshold": p.threshold, "calibrated": p.calibrated}
                            for m, p in policies.items()}
    # which heads these figures belong to: mtp-report refuses to put them beside other heads
    report["heads_sha256"] = meta.get("weights_sha256") if heads is not None else None
    report.update(config_hash=key, backbone=backbone.name, heads=cfg.eval.train_run, skipped_prompts=skipped,
                  prompt_source="file" if cfg.eval.prompts else cfg.eval.prompt_source,
                  max_new_tokens=cfg.eval.max_new_tokens, elapsed_s=round(time.time() - t0, 1))
    tok = backbone.tokenizer
    rows = [{"prompt": tok.decode(p), **{m: tok.decode(o[i]) for m, o in outputs.items()}}
            for i, p in enumerate(prompts)]
    write_json_atomic(out_dir / layout.OUTPUTS, rows)
    plots = write_plots(report, out_dir)
    # the report goes last: a rerun takes it as the mark of a finished evaluation
    path = save_report(report, out_dir)
    print_table(report)
    _to_wandb(cfg, report, plots)
    log.info("report: %s", path)
    return report


def _to_wandb(cfg: Config, report: dict, plots: list[Path]) -> None:
    from mtp_train.tracking import wandb_init

    run = wandb_init(cfg, "eval", cfg.paths.output_dir, config={"eval": dict(vars(cfg.eval))})
    if run is None:
        return
    import wandb

    cols = ["mode", *next(iter(report["modes"].values())).keys()]
    table = wandb.Table(columns=cols, data=[[m, *[json.dumps(v) if isinstance(v, list) else v
                                                   for v in r.values()]]
                                            for m, r in report["modes"].items()])
    run.log({"eval/report": table, **{f"eval/{p.stem}": wandb.Image(str(p)) for p in plots},
             **{f"eval/{m}/{k}": v for m, r in report["modes"].items() for k, v in r.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}})
    run.summary["eval/step_cost"] = report["step_cost"]
    run.finish()
