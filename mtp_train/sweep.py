"""Gather a finished sweep (`mtp-train -m ...`, local or on SLURM) into one table and one plot.

Each point of a Hydra sweep is a numbered run directory holding `.hydra/overrides.yaml` and either
`heads.json` (its final metrics) or `FAILED.txt` (why it failed); a point with neither never ran or
is still running. The report lists every point with its swept values, status, `val/sim_tau` and
per-depth agreement, and plots sim_tau against heads.k with one line per loss (or per the other
swept values).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from mtp_train import layout
from mtp_train.artifacts import read_json
from mtp_train.errors import MtpError
from mtp_train.layout import FAILED


def _overrides(run: Path) -> dict[str, str]:
    items = yaml.safe_load(layout.hydra_overrides(run).read_text()) or []
    return dict(item.split("=", 1) for item in items if "=" in item)


def gather(sweep_dir: str | Path) -> list[dict]:
    sweep_dir = Path(sweep_dir)
    runs = sorted((p.parent.parent for p in sweep_dir.glob(f"*/{layout.HYDRA_DIR}/{layout.HYDRA_OVERRIDES}")),
                  key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else p.name))
    if not runs:
        raise MtpError(f"{sweep_dir}: no sweep points here (expected <n>/.hydra/overrides.yaml)")
    rows = []
    for run in runs:
        row = {"point": run.name, "dir": str(run), "overrides": _overrides(run)}
        meta = read_json(run / layout.HEADS_META)
        if (run / FAILED).is_file():
            row.update(status="failed", error=(run / FAILED).read_text().splitlines()[0][:300])
        elif meta is not None:
            m = meta.get("metrics", {})
            row.update(status="ok", sim_tau=m.get("val/sim_tau"), k=meta.get("k"),
                       agree=[m.get(f"val/agree_d{j}") for j in range(1, (meta.get("k") or 0) + 1)],
                       slurm_job_id=(meta.get("run") or {}).get("slurm_job_id"))
        else:
            row.update(status="missing")
        rows.append(row)
    return rows


def swept_keys(rows: list[dict]) -> list[str]:
    keys = sorted({k for r in rows for k in r["overrides"]})
    return [k for k in keys if len({r["overrides"].get(k) for r in rows}) > 1]


def markdown_table(rows: list[dict]) -> str:
    keys = swept_keys(rows)
    head = ["point", *keys, "status", "val/sim_tau", "agree per depth", "slurm job"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tau = r.get("sim_tau")
        agree = " / ".join(f"{a:.2f}" for a in r.get("agree") or [] if a is not None)
        status = r["status"] if r["status"] != "failed" else f"failed: {r['error']}"
        lines.append("| " + " | ".join([r["point"], *(r["overrides"].get(k, "") for k in keys), status,
                                        f"{tau:.4f}" if isinstance(tau, float) and not math.isnan(tau) else "",
                                        agree, r.get("slurm_job_id") or ""]) + " |")
    return "\n".join(lines)


def _order(point: tuple) -> tuple:
    """Numbers in numeric order (1e-4 < 0.001 < 2), then anything else by name."""
    try:
        return (0, float(point[0]), "")
    except ValueError:
        return (1, 0.0, str(point[0]))


def plot(rows: list[dict], path: Path, x_key: str = "heads.k") -> Path | None:
    """sim_tau against `x_key`, one line per combination of the other swept values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    ok = [r for r in rows if r["status"] == "ok" and r.get("sim_tau") is not None]
    if not ok:
        return None
    if x_key not in keys:
        x_key = keys[0] if keys else None
    series: dict[str, list] = {}
    for r in ok:
        label = ", ".join(f"{k}={r['overrides'][k]}" for k in keys if k != x_key and k in r["overrides"])
        x = r["overrides"].get(x_key, r["point"]) if x_key else r["point"]
        series.setdefault(label or "sim_tau", []).append((x, r["sim_tau"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in sorted(series.items()):
        pts.sort(key=_order)
        ax.plot([str(p[0]) for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel(x_key or "point")
    ax.set_ylabel("val/sim_tau")
    ax.set_title("accepted length under greedy verification (validation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(sweep_dir: str | Path) -> dict:
    """Write sweep_report.{json,md,png} into the sweep directory; returns the JSON content."""
    from mtp_train.artifacts import write_json_atomic

    sweep_dir = Path(sweep_dir)
    rows = gather(sweep_dir)
    table = markdown_table(rows)
    png = plot(rows, sweep_dir / f"{layout.SWEEP_REPORT}.png")
    out = {"sweep_dir": str(sweep_dir), "swept": swept_keys(rows), "points": rows,
           "ok": sum(r["status"] == "ok" for r in rows),
           "failed": sum(r["status"] == "failed" for r in rows),
           "missing": sum(r["status"] == "missing" for r in rows),
           "plot": str(png) if png else None}
    write_json_atomic(sweep_dir / f"{layout.SWEEP_REPORT}.json", out)
    (sweep_dir / f"{layout.SWEEP_REPORT}.md").write_text(f"# Sweep {sweep_dir}\n\n{table}\n")
    return out
