"""The library behind `mtp-report` (mtp_train/cli/report.py): one Markdown page for a pipeline run
(what `make demo` leaves under runs/demo/).

What ran (backbone, data counts, head type, k, loss, timings per stage), the training curves
(training_curves.png from the CSV logger), the evaluation table (HF generate and every decoding
mode: speedup, tau, greedy match, repetition, NLL), the CLP and gate calibration, the per-depth
acceptance and speedup plots mtp-eval drew, and greedy vs clp outputs for three prompts. A stage
that has not run yet is listed as missing, so the page can be written at any point.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from mtp_train import layout
from mtp_train.artifacts import save_figure, write_text_atomic
from mtp_train.choices import PREDICTOR_KINDS
from mtp_train.errors import MtpError
from mtp_train.evaluation.modes import MODES
from mtp_train.goals import DEMO as TARGETS  # the demo's goals (mtp_train/goals.py)


def _json(path: Path, kind: type = dict):
    """The JSON record in `path` (an object; `kind=list` for the outputs), None when the file is not
    there; a damaged one, or one of another kind (an eval report holding [] is not "no evaluation
    yet"), is refused naming it (the stages write their records atomically: damage is an edit or a
    disk fault, never a run in progress)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise MtpError(f"{path}: not a readable JSON record ({e}); rerun the stage that wrote it") from None
    if not isinstance(value, kind):
        want = "an object" if kind is dict else "a list"
        raise MtpError(f"{path}: holds a {type(value).__name__}, not {want} as its stage writes; rerun the stage "
                       "that wrote it")
    return value


def _default_bounds() -> dict:
    """The CLP quality bounds mtp-clp calibrates against by default (ClpConfig's own values)."""
    from mtp_train.config import ClpConfig

    c = ClpConfig()
    return {"max_repetition_increase": c.max_repetition_increase, "max_nll_increase": c.max_nll_increase}


def target_rows(report: dict | None, total_s: float | None, bounds: dict | None = None,
                predictors: dict | None = None) -> list[tuple]:
    """(what, target, measured, met) for each target the run has the figures for.

    A mode whose speedup is beyond what its tau allows (flagged by mtp-eval, or found so here) never
    meets a target, and clp whose predictor is not calibrated (`predictors`: predictor.json per predictor
    kind, used when the report does not say) or commits no more than greedy (tau <= 1.01) shows
    "not calibrated (accepts nothing)", not met."""
    b = {**_default_bounds(), **(bounds or {})}
    modes = (report or {}).get("modes", {})
    flagged = flagged_modes(report)
    rows = []

    def lossless_row(mode: str, what: str, want: float) -> tuple[dict, str]:
        m = modes[mode]
        same = m.get("identical_to_greedy")
        note = ", speedup implausible (flagged)" if mode in flagged else ""
        d = (report.get("details") or {}).get(mode) or {}
        ties = (f" ({d['divergences']} differ, all at near-ties: {(report.get('decoder') or {}).get('dtype')} rounding)"
                if d.get("divergences") and d["divergences_at_near_ties"] == d["divergences"] else "")
        rows.append((what, f">= {want}x", f"{m['speedup_vs_hf']:.2f}x" + ("" if same else ", output NOT identical" + ties)
                     + note, bool(same) and m["speedup_vs_hf"] >= want and not note))
        return m, note

    if "verify" in modes:
        v, note = lossless_row("verify", "verify: speedup vs HF generate, identical output", TARGETS["verify_speedup"])
        rows.append(("verify: tau", f">= {TARGETS['verify_tau']}", f"{v['tau']:.2f}{note}",
                     v["tau"] >= TARGETS["verify_tau"] and not note))
    if "tree" in modes:
        t, note = lossless_row("tree", "tree: speedup vs HF generate (same dtype), identical output",
                               TARGETS["tree_speedup"])
        if (best := t.get("speedup_vs_best_hf")) is not None:
            rows.append(("tree: speedup vs the faster of fp32 and bf16 HF generate",
                         f">= {TARGETS['tree_best_speedup']}x", f"{best:.2f}x{note}",
                         best >= TARGETS["tree_best_speedup"] and not note))
        rows.append(("tree: tau", f">= {TARGETS['tree_tau']}", f"{t['tau']:.2f}{note}",
                     t["tau"] >= TARGETS["tree_tau"] and not note))
        if c := modes.get("verify"):
            rows.append(("tree: tau over the chain's", f">= chain + {TARGETS['tree_tau_gain']}",
                         f"{t['tau']:.2f} vs {c['tau']:.2f}", t["tau"] >= c["tau"] + TARGETS["tree_tau_gain"]))
    ref = modes.get("greedy") or modes.get("hf_generate")
    if (c := modes.get("clp")) and ref:
        what = "clp: speedup within its quality bounds"
        want = (f">= {TARGETS['clp_speedup']}x, repetition <= greedy + {b['max_repetition_increase']}, "
                f"NLL <= greedy + {b['max_nll_increase']}")
        if accepts_nothing(report, "clp", predictors):
            rows.append((what, want, "not calibrated (accepts nothing)", False))
        else:
            d_rep = c["repetition_ratio"] - ref["repetition_ratio"]
            d_nll = c["backbone_nll"] - ref["backbone_nll"]
            within = d_rep <= b["max_repetition_increase"] + 1e-9 and d_nll <= b["max_nll_increase"] + 1e-9
            note = ", speedup implausible (flagged)" if "clp" in flagged else ""
            rows.append((what, want, f"{c['speedup_vs_hf']:.2f}x, repetition {d_rep:+.3f}, NLL {d_nll:+.3f} "
                         f"(tau {c['tau']:.2f}){note}",
                         within and c["speedup_vs_hf"] >= TARGETS["clp_speedup"] and not note))
    if total_s:
        rows.append(("the whole demo", f"<= {TARGETS['minutes']:.0f} min", _minutes(total_s),
                     total_s <= 60 * TARGETS["minutes"]))
    return rows


def shortfall_lines(report: dict | None, heads: dict | None) -> list[str]:
    """What bounds the lossless targets in this run: the heads' agreement with the backbone, the tau
    the rank statistics give the largest tree, and the best predicted tau / cost over the candidate
    trees on this machine (the most a static tree can buy with these heads here)."""
    out = []
    if heads:
        m, k = heads.get("metrics") or {}, heads.get("k", 0)
        agree = [m.get(f"val/agree_d{j}") for j in range(1, k + 1)]
        if all(a is not None for a in agree):
            out.append("heads: validation agreement with the backbone's greedy token per depth "
                       + " / ".join(f"{a:.2f}" for a in agree) + f"; a chain of them reaches sim_tau "
                       f"{_fmt(m.get('val/sim_tau'), 2)}, so chain tau {TARGETS['verify_tau']} needs far more "
                       "accurate heads (more training: bench/long_run.py)")
    trees = (((report or {}).get("decoder") or {}).get("trees") or {})
    rows = [r for r in trees.get("candidates", []) if r.get("predicted_tau") is not None]
    if rows:
        big = max(rows, key=lambda r: r["nodes"])
        best = max(rows, key=lambda r: r["predicted_tau"] / (r["verify_cost"] + r["draft_cost"]))
        bound = best["predicted_tau"] / (best["verify_cost"] + best["draft_cost"])
        out.append(f"trees: the rank statistics give the largest candidate ({big['label']}, {big['nodes']} drafts) "
                   f"a predicted tau of {big['predicted_tau']:.2f} (target {TARGETS['tree_tau']}), at "
                   f"{big['verify_cost']:.2f}x the cost of a one-token forward on this machine")
        out.append(f"speed: the best predicted tau / cost over the candidates is {bound:.2f} ({best['label']}: "
                   f"tau {best['predicted_tau']:.2f} / cost {best['verify_cost'] + best['draft_cost']:.2f}), "
                   f"the most a static tree can give with these heads here; {TARGETS['tree_speedup']}x needs "
                   f"tau / cost >= {TARGETS['tree_speedup']}")
    return out


def accepts_nothing(report: dict | None, mode: str, predictors: dict | None = None) -> bool:
    """Whether a clp, gate or clp+verify run committed nothing beyond greedy: its predictor is not
    calibrated (the eval report's record of it, else that kind's predictor.json in `predictors`), or its
    measured tau is <= 1.01."""
    m = ((report or {}).get("modes") or {}).get(mode)
    kind = MODES[mode].predictor if mode in MODES else None
    if m is None or kind is None:
        return False
    if m["tau"] <= 1.01:
        return True
    calibrated = (((report or {}).get("predictors") or {}).get(mode) or {}).get("calibrated")
    if calibrated is None:
        calibrated = ((predictors or {}).get(kind) or {}).get("calibrated")
    return calibrated is False


def flagged_modes(report: dict | None) -> set[str]:
    """Modes whose speedup over HF is beyond what their tau allows: listed in the report's flags,
    or above the bound mtp-eval recorded (details[mode]["plausible_max_speedup"])."""
    report = report or {}
    modes, details = report.get("modes") or {}, report.get("details") or {}
    out = {f.split(":", 1)[0] for f in report.get("flags") or []}
    for name, m in modes.items():
        if name in ("hf_generate", "greedy"):
            continue
        bound = (details.get(name) or {}).get("plausible_max_speedup")
        if bound is not None and m["speedup_vs_hf"] > bound:
            out.add(name)
    return out


def predictor_problem(meta: dict, pred_dir: Path, heads: dict | None, heads_sha256: str | None) -> str | None:
    """Why a predictor under clp/ cannot serve the run's heads (None: it can), by the checks mtp-eval
    makes before it uses one (clp.load_predictor, the threshold's seal and range): its kind is the
    directory's, fitted on these heads' acceptance and for their k and hidden size, its weights present
    and the ones mtp-clp fitted, and a calibrated one holds a valid threshold. A predictor with a
    problem is reported as not calibrated for these heads."""
    from mtp_train.clp import check_predictor_weights, predictor_mismatch, saved_threshold

    theirs = meta.get("heads_sha256")
    bb = (heads or {}).get("backbone") or {}
    if problem := predictor_mismatch(meta, pred_dir.name, bb.get("hidden_size"), (heads or {}).get("k")):
        return f"{layout.PREDICTOR_META} in {pred_dir.name}/ {problem}"
    if theirs and heads_sha256 and theirs != heads_sha256:
        return "fitted on other heads' acceptance: rerun mtp-clp for these heads"
    weights = pred_dir / layout.PREDICTOR_FILE
    if not weights.is_file():
        return f"{layout.PREDICTOR_FILE} is missing: rerun `mtp-clp stage=fit`"
    try:
        check_predictor_weights(meta, weights)
    except MtpError:
        return f"{layout.PREDICTOR_FILE} is not the one mtp-clp fitted (sha256 differs): rerun `mtp-clp stage=fit`"
    try:
        threshold = saved_threshold(meta)
    except MtpError as e:  # "predictor.json: <why>": the file is named by the table's row
        return str(e).removeprefix("predictor.json: ")
    if meta.get("calibrated") and threshold is None:
        return "marked calibrated but holds no threshold: rerun `mtp-clp stage=calibrate`"
    return None


def calibration_figures(meta: dict, threshold: float | None = None) -> str:
    """The calibration behind a predictor's verdict, as the report prints it: for `threshold` (else
    the most cautious one decoded: where a sweep from the highest down stopped) its tau and its NLL
    and repetition increases over greedy (with the standard errors the test added), and the prompts;
    "" without a record of them."""
    cal = meta.get("calibration") or {}
    rows = [r for r in cal.get("thresholds") or [] if r.get("threshold") is not None]
    row = (next((r for r in rows if r["threshold"] == threshold), None) if threshold is not None
           else max(rows, key=lambda r: r["threshold"], default=None))
    if row is None or "nll_increase" not in row:
        return ""
    z = (meta.get("bounds") or {}).get("bound_z")
    plus = f" with {z:g} SE" if z else ""
    return (f" (at {row['threshold']:.2f}: tau {row['tau']:.2f}, NLL {row['nll_increase']:+.3f} "
            f"({row['nll_increase_upper']:+.3f}{plus}), repetition {row['repetition_increase']:+.3f} "
            f"({row['repetition_increase_upper']:+.3f}) over greedy on {cal.get('n_prompts', '?')} prompts)")


def _predictor_metas(clp_root: Path, heads: dict | None, heads_sha256: str | None) -> dict:
    """kind -> predictor.json for each predictor directory under clp/ (one without it: {"problem": why}),
    with `problem` (predictor_problem) and calibrated=False where it cannot serve these heads, and
    `shown_threshold`, the saved threshold where it passes its checks."""
    from mtp_train.clp import saved_threshold

    out = {}
    for kind in PREDICTOR_KINDS:
        pred_dir = layout.predictor_dir(clp_root, kind)
        if not pred_dir.is_dir():
            continue
        if (m := _json(pred_dir / layout.PREDICTOR_META)) is None:  # a damaged one is refused, naming it
            out[kind] = {"calibrated": False, "problem": f"{layout.PREDICTOR_META} is missing: rerun `mtp-clp stage=fit`"}
            continue
        try:
            shown = saved_threshold(m)
        except MtpError:
            shown = None
        if problem := predictor_problem(m, pred_dir, heads, heads_sha256):
            m = {**m, "calibrated": False, "problem": problem}
        out[kind] = {**m, "shown_threshold": shown}
    return out


_PROMPT_SOURCES = {"validation": "held-out prompts", "file": "prompts from eval.prompts",
                   "unseen": "unseen prompts (conversations the data stage never took)"}


def _fmt(x, nd: int = 3, thousands: bool = False) -> str:
    if x is None:
        return "-"
    if thousands and isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _minutes(s) -> str:
    return "-" if s is None else f"{s / 60:.1f} min"


def training_curves(train_dir: Path, out: Path) -> Path | None:
    """train/loss per step and val/sim_tau + val agreement per depth against step, from metrics.csv."""
    files = layout.csv_metrics(train_dir)
    if not files:
        return None
    rows = []
    for f in files:  # a resumed run writes a new version: read them all, in order
        with f.open() as fh:
            rows += list(csv.DictReader(fh))

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = sorted({int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}.items())
        return [p[0] for p in pts], [p[1] for p in pts]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(*series("train/loss_step"), label="train loss", lw=1)
    a.plot(*series("val/loss"), "o-", label="val loss")
    a.set_xlabel("step")
    a.set_title("loss")
    a.legend(fontsize=8)
    b.plot(*series("val/sim_tau"), "o-", label="val sim_tau", color="black")
    b.set_xlabel("step")
    b.set_title("validation: sim_tau and agreement per depth")
    b2 = b.twinx()
    j = 1
    while rows and f"val/agree_d{j}" in rows[0]:  # the CSV header names every logged depth
        b2.plot(*series(f"val/agree_d{j}"), "--", label=f"agree d{j}")
        j += 1
    b.legend(loc="upper left", fontsize=8)
    b2.legend(loc="lower right", fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
    plt.close(fig)
    return out


def _data_section(train_dir: Path, heads: dict) -> tuple[list[str], dict]:
    """Data counts from the prepared datasets' manifests, found through the run's saved config;
    `heads` is the run's heads.json (it records the cache the run trained from)."""
    from mtp_train.pipeline.export import load_recipe

    try:
        cfg = load_recipe(train_dir)
    except MtpError:
        return ["(no saved config in the training run: data counts unknown)"], {}
    base = Path(cfg.data.output_dir)
    lab, dis = _json(base / layout.LABELLED / layout.MANIFEST), _json(base / layout.DISTILLED / layout.MANIFEST)
    lines, times = [], {}
    if lab:
        lines.append(f"- original data (`{cfg.data.source}`): {lab['splits']['train']:,} train / "
                     f"{lab['splits']['validation']:,} validation conversations, "
                     f"{lab['assistant_tokens']['train']:,} assistant tokens (train)")
        times["data"] = lab.get("elapsed_s")
    if dis:
        lines.append(f"- self-distilled: {dis['splits']['train']:,} train / {dis['splits']['validation']:,} "
                     f"validation answers by the backbone, {dis['answer_tokens']['train']:,} answer tokens (train)")
        times["distill"] = dis.get("elapsed_s_this_run")
    max_length = layout.max_length(cfg)
    cache = (heads.get("recipe") or {}).get("cache")  # None: trained live
    if cache and (c := _json(Path(cache) / layout.MANIFEST)):
        lines.append(f"- hidden-state cache: {c['tokens']:,} tokens, {c['bytes'] / 1e6:.0f} MB "
                     f"({c['bytes_per_token']:.0f} bytes/token)")
        times["cache"] = c.get("elapsed_s_this_run")
    lines.append(f"- training uses `train.data_use={cfg.train.data_use}`, rows cropped to {max_length} tokens")
    return lines, times


def write_report(run_root: str | Path) -> Path:
    """<run_root>/report.md, written atomically; a run directory whose records lack what the page
    reads (another version's, or edited) is refused in one line naming what is missing."""
    root = Path(run_root)
    if not root.is_dir():
        raise MtpError(f"{root}: not a directory; mtp-report reads a pipeline run's directory "
                       "(the one holding train/, clp/ and eval/)")
    try:
        return _write_report(root)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError, StopIteration) as e:
        raise MtpError(f"{root}: a record there lacks what the report reads ({type(e).__name__}: {e}); "
                       "train/heads.json, eval/eval_report.json and clp/ are written by mtp-train, mtp-eval "
                       "and mtp-clp of this version: rerun the stage whose record was edited") from None
    except OSError as e:  # a read-only run directory, a full disk, report.md a directory
        raise MtpError(f"{root / layout.REPORT}: cannot write the report ({e.strerror}); nothing was changed") from None


def check_same_heads(heads: dict, report: dict, train: Path, ev: Path) -> None:
    """An evaluation of other heads (the run retrained since, with another k) is not put beside
    these heads' figures: refused naming both (reports from before the heads' digest was recorded
    are checked by k only)."""
    theirs, ours = report.get("heads_sha256"), heads.get("weights_sha256")
    stale = (theirs and ours and theirs != ours) or (report.get("k") is not None and report.get("k") != heads.get("k"))
    if stale:
        raise MtpError(f"{ev / layout.EVAL_REPORT} was measured on other heads than {train / layout.HEADS_FILE} holds "
                       f"now (k={report.get('k')}, weights {str(theirs)[:12]} vs k={heads.get('k')}, "
                       f"{str(ours)[:12]}); rerun mtp-eval on this run")


def check_report_figures(report: dict, path: Path) -> None:
    """Refuse, naming the file and the figure, an eval report holding what no decoding measures: a
    non-finite number, tau outside [1, k + 1] (the backbone's token plus at most one per head),
    a rate outside [0, 1], a speed that is not positive. mtp-eval writes these; an impossible one is an
    edit or a damaged file, not a result to put on the page."""
    import math

    def bad(where: str, value, why: str) -> MtpError:
        return MtpError(f"{path}: {where} is {value!r}, {why}; the file was edited or damaged: rerun mtp-eval")

    k = report.get("k")
    modes = report.get("modes")
    if not isinstance(modes, dict):
        raise bad("modes", modes, "not a record per mode")
    for mode, r in modes.items():
        if not isinstance(r, dict):
            raise bad(f"modes.{mode}", r, "not a record")
        for key, value in r.items():
            values = value if key == "acceptance" and isinstance(value, list) else [value]
            for v in values:
                if isinstance(v, float) and not math.isfinite(v):
                    raise bad(f"modes.{mode}.{key}", v, "not a finite number")
        tau = r.get("tau")
        if tau is not None and (not isinstance(tau, (int, float)) or tau < 1 - 1e-9
                                or (isinstance(k, int) and tau > k + 1 + 1e-9)):
            raise bad(f"modes.{mode}.tau", tau, f"outside [1, k + 1 = {k + 1 if isinstance(k, int) else '?'}]")
        if (v := r.get("greedy_match_rate")) is not None and not (isinstance(v, (int, float)) and 0 <= v <= 1):
            raise bad(f"modes.{mode}.greedy_match_rate", v, "not a rate in [0, 1]")
        for i, v in enumerate(r.get("acceptance") or []):
            if v is not None and not (isinstance(v, (int, float)) and 0 <= v <= 1):
                raise bad(f"modes.{mode}.acceptance[{i}]", v, "not a rate in [0, 1]")
        for key in ("speedup_vs_hf", "tokens_per_s"):
            if (v := r.get(key)) is not None and not (isinstance(v, (int, float)) and v > 0):
                raise bad(f"modes.{mode}.{key}", v, "not a positive number")


def _write_report(root: Path) -> Path:
    train, clp, ev = layout.pipeline_dirs(root)
    heads = _json(train / layout.HEADS_META)
    report = _json(ev / layout.EVAL_REPORT)
    if report is not None:
        check_report_figures(report, ev / layout.EVAL_REPORT)
    if heads is None and report is None:
        raise MtpError(f"{root}: no train/heads.json and no eval/eval_report.json; nothing to report")
    if heads and report:
        check_same_heads(heads, report, train, ev)
    md = [f"# mtp-train report: {root}", ""]

    md += ["## What ran", ""]
    times: dict = {}
    if heads:
        from mtp_train.heads.persist import heads_config_from

        heads_config_from(heads, train / layout.HEADS_META)  # its summary fields agree with its settings
        data_lines, times = _data_section(train, heads)
        m = heads.get("metrics", {})
        md += [f"- backbone: `{heads['backbone']['name']}` (hidden {heads['backbone']['hidden_size']}, "
               f"vocabulary {heads['backbone']['vocab_size']:,}), frozen",
               *data_lines,
               f"- heads: {heads['head_type']}, k = {heads['k']}, draft vocabulary "
               f"{heads.get('draft_size') or 'full'}; loss {heads['loss']['name']}"
               f"{' + AdaMTP' if heads['loss'].get('adamtp') else ''}",
               f"- validation after training: sim_tau {_fmt(m.get('val/sim_tau'))}, agreement per depth "
               + " / ".join(_fmt(m.get(f"val/agree_d{j}"), 2) for j in range(1, heads["k"] + 1))]
        times["train"] = (heads.get("run") or {}).get("elapsed_s")
    else:
        md.append("- training: missing")
    stage_times = _json(clp / layout.STAGE_TIMES) or {}
    times["clp"] = sum(stage_times.values()) if stage_times else None
    times["eval"] = report.get("elapsed_s") if report else None
    md += ["", "| stage | wall time |", "|---|---|"]
    md += [f"| {k} | {_minutes(v)} |" for k, v in times.items()]
    total = sum(v for v in times.values() if v)
    md += [f"| total | {_minutes(total)} |", ""]
    md += _budget_section(heads, report, times)
    bounds = (_json(layout.predictor_dir(clp, "clp") / layout.PREDICTOR_META) or {}).get("bounds")
    # the heads: heads.json's digest, else the one the evaluation measured
    predictors = _predictor_metas(clp, heads, (heads or {}).get("weights_sha256") or (report or {}).get("heads_sha256"))
    if rows := target_rows(report, total, bounds, predictors):
        md += ["## Targets", "", "| target | wanted | measured | met |", "|---|---|---|---|"]
        md += [f"| {what} | {want} | {got} | {'yes' if met else '**no**'} |" for what, want, got, met in rows]
        md.append("")
        if not all(r[3] for r in rows) and (why := shortfall_lines(report, heads)):
            md += ["Where the shortfall comes from (measured in this run):", "", *[f"- {w}" for w in why], ""]

    png = training_curves(train, root / layout.TRAINING_CURVES) if heads else None
    if png:
        md += ["## Training", "", f"![training curves]({png.name})", ""]

    if report:
        from mtp_train.evaluation.render import format_speedup

        rounds = report.get("rounds", 1)
        md += ["## Decoding", "",
               f"{next(iter(report['modes'].values())).get('n_prompts', '?')} {_PROMPT_SOURCES.get(report.get('prompt_source'), 'held-out prompts')}, "
               f"{report.get('max_new_tokens')} new tokens; speedup is HF `generate` greedy's wall time over the mode's on "
               f"the same prompts in the same run"
               + (f", the median of {rounds} timing rounds (min-max in brackets)" if rounds > 1 else "")
               + f" (step cost {_fmt(report.get('step_cost'), 2)}).", "",
               "| mode | speedup | tokens/s | tau | acceptance per depth | greedy match | repetition | backbone NLL |",
               "|---|---|---|---|---|---|---|---|"]
        for mode, r in report["modes"].items():
            acceptance = " / ".join(_fmt(a, 2) for a in r.get("acceptance") or []) or "-"
            md.append(f"| {mode} | {format_speedup(r, (report.get('details') or {}).get(mode))} | "
                      f"{_fmt(r['tokens_per_s'], 1)} | "
                      f"{_fmt(r['tau'], 2)} | {acceptance} | {_fmt(r['greedy_match_rate'], 2)} | "
                      f"{_fmt(r['repetition_ratio'])} | {_fmt(r['backbone_nll'])} |")
        md.append("")
        if flags := report.get("flags"):
            md += ["**Flags** (a step costs at least one backbone forward, so no mode can beat HF by more "
                   "than 1.15 x tau x our greedy's speedup; these speedups do not measure the mode):", ""]
            md += [f"- {line}" for line in flags]
            md.append("")
        if lines := report.get("divergence"):
            md += ["**Lossless modes whose output is not greedy's** (the margin is how far the backbone preferred "
                   "greedy's token where the two first differ):", ""]
            md += [f"- {line}" for line in lines]
            md.append("")
        md += _sampling_section(report)
        md += _decoder_section(report)
        for name in layout.EVAL_PLOTS:
            if (ev / name).is_file():
                md.append(f"![{name[:-4]}]({layout.EVAL_DIR}/{name})")
        md.append("")

    md += _serving_section(train)

    if predictors:
        def calibrated(m: dict) -> str:
            if m.get("problem"):
                return f"no: {m['problem']}"
            if m.get("calibrated"):
                return "yes" + calibration_figures(m, m.get("threshold"))
            if "calibration" in m:
                return "no threshold met the bounds, accepts nothing extra" + calibration_figures(m)
            why = f" ({m['not_calibrated']})" if m.get("not_calibrated") else ""
            return f"not calibrated{why}: accepts nothing extra"

        md += ["## Span-length predictors", "", "| predictor | parameters | threshold | calibrated |", "|---|---|---|---|"]
        md += [f"| {k} | {_fmt(m.get('parameters'), thousands=True)} | "
               f"{_fmt(m.get('shown_threshold'), 2)} | "
               f"{calibrated(m)} |" for k, m in predictors.items()]
        md.append("")

    outputs = _json(ev / layout.OUTPUTS, list)
    if outputs:
        other = next((m for m in ("clp", "gate", "verify") if m in outputs[0]), None)
        md += ["## Sample outputs", ""]
        for i, row in enumerate(outputs[:3]):
            md += [f"**Prompt {i + 1}.** {_quote(row['prompt'])}", "",
                   f"*greedy*: {_quote(row.get('greedy', row.get('hf_generate', '')))}", ""]
            if other:
                md += [f"*{other}*: {_quote(row[other])}", ""]
    path = root / layout.REPORT
    write_text_atomic(path, "\n".join(md) + "\n")
    return path


def _budget_section(heads: dict | None, report: dict | None, times: dict) -> list[str]:
    """Where a deadline's minutes went: the machine, the time training was given and how many
    steps it reached, the later stages' predicted time against what they took, what mtp-eval cut."""
    b = ((heads or {}).get("recipe") or {}).get("budget")
    sized = (report or {}).get("sized_to_deadline")
    if not b and not sized:
        return []
    md = ["## Time budget", ""]
    if b:
        if b.get("cpu"):
            a = b["after_train"]
            prefill = f" after a {a['prefill_s']:.2f} s prefill" if a.get("prefill_s") is not None else ""
            md.append(f"- machine: {b['cpu']}; HF generate {1 / a['token_s']:.1f} tokens/s{prefill} in "
                      f"{b.get('dtype')} (the probe that prices the later stages)")
        if b.get("deadline") is not None:
            after = b["after_train"]
            took = sum(times.get(s) or 0 for s in after["decodes"])
            md.append(f"- deadline: {_minutes(b['left_s'])} left when training started; the later stages "
                      f"({', '.join(after['decodes']) or 'none'}) predicted {_minutes(after['total_s'])}, took "
                      f"{_minutes(took) if took else 'n/a'}; margin {_minutes(b['margin_s'])}")
        if (u := b.get("sampled_unreserved")):
            md.append(f"- the sampled runs (T={u['temperatures']}, predicted {_minutes(u['sampled_s'])}) were not "
                      f"reserved: with them training would have had {_minutes(u['training_with_s'])}, under "
                      f"budget.train_first_min; mtp-eval ran them only if its greedy decodes left the time")
        md.append(f"- training: budget {_minutes(b['budget_s'])}, spent {_minutes(b['spent_s'])}; {b['steps']} steps "
                  f"(floor {b['min_steps']}, cap {b['max_steps']}) at {_fmt(b.get('step_s'), 2)} s a step, "
                  f"validation {_fmt(b.get('validation_s'), 1)} s")
    if sized:
        md.append(f"- evaluation: {_minutes(sized['left_s'])} left, predicted {_minutes(sized['predicted_full_s'])} "
                  f"as asked; " + ("cut: " + "; ".join(sized["cut"]) if sized["cut"] else "nothing cut"))
        if (fit := sized.get("sampled_fit")) and not fit["cut"]:
            md.append(f"- sampled runs kept: {_minutes(fit['per_temperature_s'])} each, predicted from the greedy "
                      f"decodes' time, with {_minutes(fit['left_s'])} left")
    return [*md, ""]


def _serving_section(train_dir: Path) -> list[str]:
    """mtp-serve-check's result for the run's heads, when it ran (mtp_train/engine/check.py)."""
    from mtp_train.engine.check import SERVE_CHECK, SERVE_CHECK_DIR, summary_lines

    result = _json(train_dir / SERVE_CHECK_DIR / SERVE_CHECK)
    if not result:
        return []
    return ["## Served in an engine", "",
            "`mtp-serve-check`: the heads exported and served in a real engine, its own acceptance counters "
            "against our decoder's chain on the same prompts:", "",
            *[f"- {line}" for line in summary_lines(result)], ""]


def _sampling_section(report: dict) -> list[str]:
    """tau and speedup per mode at temperature 0 (greedy) and each sampled temperature, side by side,
    and the training metric that predicts the sampled chain's tau (eval.sampling)."""
    from mtp_train.evaluation.render import by_temperature, format_speedup

    runs = report.get("sampled")
    if not runs:
        return []
    first = next(iter(runs.values()))
    temps = [0.0] + [run["temperature"] for run in runs.values()]
    warp = ", ".join(f"{k}={first[k]}" for k in ("top_k", "top_p", "min_p") if first[k] not in (0, 1.0, None))
    md = ["### Under sampling", "",
          f"Speculative sampling (lossless: the outputs are the backbone's own samples) against HF `generate` with "
          f"`do_sample=True` and the same warpers{' (' + warp + ')' if warp else ''}, "
          f"{first['samples_per_prompt']} seeded sample(s) per prompt; a sampled speedup is the ratio of tokens/s "
          "(samples differ in length). Each cell: tau / speedup (min-max over rounds).", "",
          "| mode | " + " | ".join(f"T={t:g}" for t in temps) + " |", "|---|" + "---|" * len(temps)]
    for name, by_t in by_temperature(report).items():
        cells = [f"{_fmt(by_t[t][0]['tau'], 2)} / {format_speedup(*by_t[t])}" if t in by_t else "-" for t in temps]
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    md.append("")
    predicted = report.get("sim_tau_sampled") or {}
    lines = []
    for run in runs.values():
        want = predicted.get(f"{run['temperature']:.1f}")
        chain = run["modes"].get("verify")
        if want is not None and chain is not None:
            lines.append(f"T={run['temperature']:g}: training's val/sim_tau_t{run['temperature']:.1f} {want:.2f}, "
                         f"decoded verify tau {chain['tau']:.2f} (difference {chain['tau'] - want:+.2f})")
    if lines:
        md += ["The training metric for sampled acceptance against the decoded chain:", ""]
        md += [f"- {line}" for line in lines]
        md.append("")
    return md


def _decoder_section(report: dict) -> list[str]:
    """The machine, the dtype, the verify cost curve and the trees weighed against it."""
    dec, mach = report.get("decoder") or {}, report.get("machine") or {}
    if not dec:
        return []
    curve, trees = dec.get("verify_costs") or {}, dec.get("trees") or {}
    md = ["### The decoder on this machine", "",
          f"- CPU: {mach.get('cpu', '?')}, {mach.get('threads', '?')} threads, native bf16: "
          f"{mach.get('native_bf16')}; decoding in {dec.get('dtype')}; HF generate tokens/s by dtype: "
          + ", ".join(f"{d} {v:.1f}" for d, v in (report.get("hf_dtypes") or {}).items())]
    if curve:
        md.append(f"- verify cost (forward over n tokens / one token of {curve['one_token_ms']:.1f} ms, "
                  f"medians of {curve.get('rounds')} rounds, each size timed between two one-token forwards, "
                  f"made non-decreasing): "
                  + ", ".join(f"{n}: {c:.2f}" for n, c in curve["costs"].items()))
    if trees:
        md.append(f"- mode tree verifies `{trees.get('static')}`, dynamic `{trees.get('dynamic')}`; "
                  f"adaptive (cost) chooses among {', '.join(trees.get('pareto') or [])}"
                  + (f"; per entropy bucket: {', '.join(trees['entropy_trees'])}" if trees.get("entropy_trees") else ""))
        md += ["", "| tree | nodes | depth | predicted tau | verify cost | draft cost | tau / cost |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {r['label']} | {r['nodes']} | {r['depth']} | {_fmt(r['predicted_tau'], 2)} | "
               f"{r['verify_cost']:.2f} | {r['draft_cost']:.2f} | {_fmt(r['rate'], 2)} |"
               for r in trees.get("candidates", [])]
    return [*md, ""]


def _quote(text: str, limit: int = 600) -> str:
    text = " ".join(str(text).split())
    return (text[:limit] + " ...") if len(text) > limit else text


def summary(run_root: str | Path) -> str:
    """The lines printed at the end of `make demo`: speedup and tau per mode."""
    report = _json(layout.pipeline_dirs(run_root)[2] / layout.EVAL_REPORT)
    if not report:
        return "no evaluation yet"
    check_report_figures(report, layout.pipeline_dirs(run_root)[2] / layout.EVAL_REPORT)
    from mtp_train.evaluation.render import format_speedup

    lines = [f"  {mode:<12} {format_speedup(r, (report.get('details') or {}).get(mode))}  tau {r['tau']:.2f}  "
             f"rep {r['repetition_ratio']:.3f}  NLL {r['backbone_nll']:.3f}" for mode, r in report["modes"].items()]
    lines += [f"  flag: {line}" for line in report.get("flags") or []]
    lines += [f"  not identical to greedy: {line}" for line in report.get("divergence") or []]
    train, clp = layout.pipeline_dirs(run_root)[:2]
    bounds = (_json(layout.predictor_dir(clp, "clp") / layout.PREDICTOR_META) or {}).get("bounds")
    heads = _json(train / layout.HEADS_META)
    heads_sha = (heads or {}).get("weights_sha256") or report.get("heads_sha256")
    lines += [f"  target {'met' if met else 'NOT met'}: {what} {want}: {got}"
              for what, want, got, met in target_rows(report, None, bounds, _predictor_metas(clp, heads, heads_sha))]
    return "\n".join(lines)
