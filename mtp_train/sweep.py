"""A finished sweep (`mtp-train -m ...`, local or on SLURM) as one table and one plot.

Each point of a Hydra sweep is a run directory (`<n>-<point name>`, mtp_train/tracking.py) holding
`.hydra/overrides.yaml` and either `heads.json` (its final metrics) or `FAILED.txt` (why it failed);
a point with neither never ran or is still running. With `train.eval_after=true` a point also holds
`eval/eval_report.json` (decoded on the sweep's shared prompts). The report lists every point with
its swept values, status (a failed one with its reason), `val/sim_tau`, agreement and accuracy per
depth and, when evaluated, each mode's decode tau and speedup over HF generate; it plots them
against heads.k with one line per loss (or per the other swept values), failed points marked.

`summarize` writes it and, with logger=wandb, logs it as a table and image to a `sweep` job in the
sweep's W&B group; the Hydra callback in mtp_train/cli/sweep.py calls it at the end of every
mtp-train multirun.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import yaml

from mtp_train import layout
from mtp_train.artifacts import read_json, save_figure, write_text_atomic
from mtp_train.errors import MtpError
from mtp_train.layout import FAILED

log = logging.getLogger(__name__)


def _overrides(run: Path) -> dict[str, str]:
    items = yaml.safe_load(layout.hydra_overrides(run).read_text()) or []
    return dict(item.split("=", 1) for item in items if "=" in item)


def _number(run: Path) -> tuple:
    """Points in launch order: by the job number their directory name starts with."""
    head = run.name.split("-", 1)[0]
    return (not head.isdigit(), int(head) if head.isdigit() else 0, run.name)


def _decoded(run: Path) -> dict:
    """tau and speedup per decoding mode from the point's eval/eval_report.json ({} without one)."""
    report = read_json(run / "eval" / layout.EVAL_REPORT)
    if not report:
        return {}
    return {mode: {"tau": r.get("tau"), "speedup_vs_hf": r.get("speedup_vs_hf"),
                   "identical_to_greedy": r.get("identical_to_greedy")}
            for mode, r in report.get("modes", {}).items() if mode != "hf_generate"}


def gather(sweep_dir: str | Path, since: float | None = None) -> list[dict]:
    """One row per point of the sweep directory; with `since` (a multirun's start time) only the points
    that multirun ran (their .hydra/ record is that recent): a reused directory's older points of
    another sweep are not this sweep's."""
    sweep_dir = Path(sweep_dir)
    runs = sorted((p.parent.parent for p in sweep_dir.glob(f"*/{layout.HYDRA_DIR}/{layout.HYDRA_OVERRIDES}")
                   if since is None or p.stat().st_mtime >= since), key=_number)
    if not runs:
        raise MtpError(f"{sweep_dir}: no sweep points here (expected <n>/.hydra/overrides.yaml)")
    rows = []
    for run in runs:
        row = {"point": run.name, "dir": str(run), "overrides": _overrides(run)}
        meta = read_json(run / layout.HEADS_META)
        if (run / FAILED).is_file():
            row.update(status="failed", error=(run / FAILED).read_text().splitlines()[0][:300])
        elif meta is not None:
            m, depths = meta.get("metrics", {}), range(1, (meta.get("k") or 0) + 1)
            row.update(status="ok", sim_tau=m.get("val/sim_tau"), k=meta.get("k"),
                       agree=[m.get(f"val/agree_d{j}") for j in depths],
                       acc=[m.get(f"val/acc_d{j}") for j in depths],
                       decoded=_decoded(run),
                       slurm_job_id=(meta.get("run") or {}).get("slurm_job_id"))
        else:
            row.update(status="missing")
        rows.append(row)
    return rows


def swept_keys(rows: list[dict]) -> list[str]:
    keys = sorted({k for r in rows for k in r["overrides"]})
    return [k for k in keys if len({r["overrides"].get(k) for r in rows}) > 1]


def decoded_modes(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(m for r in rows for m in r.get("decoded") or {}))


def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not math.isnan(x) else ""


def markdown_table(rows: list[dict]) -> str:
    keys, modes = swept_keys(rows), decoded_modes(rows)
    head = ["point", *keys, "status", "val/sim_tau", "agree per depth", "accuracy per depth",
            *(f"{m} tau / speedup" for m in modes), "slurm job"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    per_depth = lambda xs: " / ".join(f"{a:.2f}" for a in xs or [] if a is not None)  # noqa: E731
    for r in rows:
        status = r["status"] if r["status"] != "failed" else f"failed: {r['error']}"
        dec = r.get("decoded") or {}
        lines.append("| " + " | ".join([
            r["point"], *(r["overrides"].get(k, "") for k in keys), status, _fmt(r.get("sim_tau"), ".4f"),
            per_depth(r.get("agree")), per_depth(r.get("acc")),
            *(f"{_fmt(dec[m]['tau'], '.2f')} / {_fmt(dec[m]['speedup_vs_hf'], '.2f')}x" if m in dec else ""
              for m in modes),
            r.get("slurm_job_id") or ""]) + " |")
    return "\n".join(lines)


def _order(point: tuple) -> tuple:
    """Numbers in numeric order (1e-4 < 0.001 < 2), then anything else by name."""
    try:
        return (0, float(point[0]), "")
    except ValueError:
        return (1, 0.0, str(point[0]))


def plot(rows: list[dict], path: Path, x_key: str = "heads.k") -> Path | None:
    """val/sim_tau (and, for evaluated sweeps, each point's decode tau and speedup in its first
    decoded mode) against `x_key`, one line per combination of the other swept values; a failed
    point is a red cross at its x on the bottom edge, so it shows as failed, not as a gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    if not any(r["status"] in ("ok", "failed") for r in rows):
        return None
    if x_key not in keys:
        x_key = keys[0] if keys else None
    mode = next(iter(decoded_modes(rows)), None)
    panels = [("val/sim_tau", lambda r: r.get("sim_tau"))]
    if mode:
        panels += [(f"decode tau ({mode})", lambda r: (r.get("decoded") or {}).get(mode, {}).get("tau")),
                   (f"speedup vs HF generate ({mode})",
                    lambda r: (r.get("decoded") or {}).get(mode, {}).get("speedup_vs_hf"))]
    x_of = lambda r: str(r["overrides"].get(x_key, r["point"]) if x_key else r["point"])  # noqa: E731
    label_of = lambda r: ", ".join(f"{k}={r['overrides'][k]}" for k in keys  # noqa: E731
                                   if k != x_key and k in r["overrides"])
    xs = sorted({x_of(r) for r in rows if r["status"] in ("ok", "failed")}, key=lambda x: _order((x,)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, value) in zip(axes[0], panels, strict=True):
        series: dict[str, list] = {}
        for r in rows:
            v = value(r) if r["status"] == "ok" else None
            if isinstance(v, (int, float)) and not math.isnan(v):
                series.setdefault(label_of(r) or title, []).append((xs.index(x_of(r)), v))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        failed = [r for r in rows if r["status"] == "failed"]
        for i, r in enumerate(failed):
            ax.plot([xs.index(x_of(r))], [0], marker="x", color="red", markersize=10, clip_on=False,
                    transform=ax.get_xaxis_transform(), label="failed" if i == 0 else None)
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel(x_key or "point")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def report(sweep_dir: str | Path, since: float | None = None) -> dict:
    """Write sweep_report.{json,md,png} into the sweep directory (the points `gather` takes); returns
    the JSON content."""
    from mtp_train.artifacts import write_json_atomic

    sweep_dir = Path(sweep_dir)
    rows = gather(sweep_dir, since)
    table = markdown_table(rows)
    png = plot(rows, sweep_dir / f"{layout.SWEEP_REPORT}.png")
    out = {"sweep_dir": str(sweep_dir), "swept": swept_keys(rows), "points": rows,
           "ok": sum(r["status"] == "ok" for r in rows),
           "failed": sum(r["status"] == "failed" for r in rows),
           "missing": sum(r["status"] == "missing" for r in rows),
           "plot": str(png) if png else None}
    write_json_atomic(sweep_dir / f"{layout.SWEEP_REPORT}.json", out)
    write_text_atomic(sweep_dir / f"{layout.SWEEP_REPORT}.md", f"# Sweep {sweep_dir}\n\n{table}\n")
    return out


def to_wandb(cfg, out: dict, group: str) -> None:
    """The summary as a W&B table (one row per point, failed ones with their reason) and the plot,
    logged by a `sweep` job in the sweep's group; nothing without logger=wandb."""
    from mtp_train.tracking import wandb_init

    run = wandb_init(cfg, "sweep", out["sweep_dir"], name=f"{group}-summary", group=group,
                     tags=[f"swept={k}"[:64] for k in out["swept"]])
    if run is None:
        return
    import wandb

    rows, keys = out["points"], out["swept"]
    modes = decoded_modes(rows)
    cols = ["point", *keys, "status", "reason", "val/sim_tau", "agree_per_depth", "acc_per_depth",
            *(f"{m}/{q}" for m in modes for q in ("tau", "speedup_vs_hf")), "slurm_job_id"]
    data = [[r["point"], *(r["overrides"].get(k) for k in keys), r["status"], r.get("error"), r.get("sim_tau"),
             json.dumps(r.get("agree")), json.dumps(r.get("acc")),
             *((r.get("decoded") or {}).get(m, {}).get(q) for m in modes for q in ("tau", "speedup_vs_hf")),
             r.get("slurm_job_id")] for r in rows]
    run.log({"sweep/summary": wandb.Table(columns=cols, data=data),
             **({"sweep/plot": wandb.Image(out["plot"])} if out.get("plot") else {})})
    run.summary.update({"sweep/ok": out["ok"], "sweep/failed": out["failed"], "sweep/missing": out["missing"]})
    run.finish()


def summarize(cfg, sweep_dir: str | Path, since: float | None = None) -> dict | None:
    """The summary of a finished mtp-train multirun (its points: those run since `since`): written
    beside the points, printed, and with logger=wandb logged to the sweep's W&B group (`cfg`: the
    sweep's config). None without points."""
    from mtp_train.tracking import sweep_group

    sweep_dir = Path(sweep_dir)
    try:
        out = report(sweep_dir, since)
    except MtpError as e:
        log.warning("sweep summary: %s", e)
        return None
    print(markdown_table(out["points"]))
    log.info("sweep summary: %d ok, %d failed, %d missing; %s", out["ok"], out["failed"], out["missing"],
             sweep_dir / f"{layout.SWEEP_REPORT}.md")
    to_wandb(cfg, out, sweep_group(cfg.experiment_name, sweep_dir))
    return out
