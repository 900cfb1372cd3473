"""Scaling curve: accepted length (tau) and verify speedup against training tokens, for the original
ShareGPT answers and the backbone's own (self-distilled) answers.

    python bench/scaling.py                                   # the demo recipe, 1/4, 1/2 and all of its data
    python bench/scaling.py --fractions 0.25,0.5,1 --prompts 4 trainer.max_steps=80
    python bench/scaling.py --out runs/scaling_gpu trainer=gpu data.max_conversations=null

Every point trains the same recipe for the same number of steps (same compute) on the first
fraction of one data source, then decodes held-out prompts in verify mode against HF `generate` in
the same process. Each stage is resumable: a rerun skips points already trained and measured.
Writes <out>/scaling.{json,md,png} and prints the table and, per source, a log-linear fit
tau = a + b ln(tokens) with the tokens it would need for tau 1.9 (an extrapolation, say so when quoting).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from mtp_train import layout
from mtp_train.cli.common import compose_config
from mtp_train.goals import DEMO

TARGET_TAU = DEMO["verify_tau"]  # the chain's goal (mtp_train/goals.py)


def _cfg(overrides: list[str]):
    return compose_config(["experiment=smollm2_demo", "logger=csv", *overrides])  # unless another is named


def run_point(out: Path, source: str, fraction: float, prompts: int, overrides: list[str]) -> dict:
    from mtp_train.pipeline.evaluation import run_eval
    from mtp_train.pipeline.training import run_train

    run = out / f"{source}-{fraction:g}"
    common = [*overrides, f"train.data_use={source}"]
    run_train(_cfg([*common, f"train.data_fraction={fraction}", f"paths.output_dir={run}"]))
    heads = json.loads((run / layout.HEADS_META).read_text())
    report = run_eval(_cfg([*common, f"eval.train_run={run}", "eval.modes=[verify]", f"eval.n_prompts={prompts}",
                            f"paths.output_dir={run}/eval"]))
    v = report["modes"]["verify"]
    return {"source": source, "fraction": fraction, "train_rows": heads["recipe"]["train_rows"],
            "train_tokens": heads["recipe"]["train_tokens"], "steps": heads["recipe"]["steps"],
            "sim_tau": heads["metrics"]["val/sim_tau"],
            "agree": [heads["metrics"].get(f"val/agree_d{j}") for j in range(1, heads["k"] + 1)],
            "tau": v["tau"], "verify_speedup": v["speedup_vs_hf"], "step_cost": report["step_cost"],
            "identical_to_greedy": v["identical_to_greedy"], "hf_tokens_per_s": report["modes"]["hf_generate"]["tokens_per_s"]}


def log_fit(points: list[dict]) -> dict | None:
    """Least squares tau = a + b ln(tokens) and the tokens at which it reaches TARGET_TAU."""
    xs = [math.log(p["train_tokens"]) for p in points]
    ys = [p["tau"] for p in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    need = math.exp((TARGET_TAU - a) / b) if b > 0 else None
    return {"a": a, "b": b, "tokens_for_target": need}


def write_outputs(out: Path, points: list[dict], fits: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mtp_train.artifacts import write_json_atomic

    write_json_atomic(out / "scaling.json", {"points": points, "fits": fits, "target_tau": TARGET_TAU})
    lines = ["| data | fraction | rows | training tokens | steps | val sim_tau | decode tau | verify vs HF |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p['source']} | {p['fraction']:g} | {p['train_rows']} | {p['train_tokens']:,} | {p['steps']} | "
              f"{p['sim_tau']:.3f} | {p['tau']:.3f} | {p['verify_speedup']:.2f}x |" for p in points]
    for source, fit in fits.items():
        if fit:
            need = fit["tokens_for_target"]
            lines.append(f"\n{source}: tau = {fit['a']:.3f} + {fit['b']:.3f} ln(tokens); tau {TARGET_TAU} at "
                         + (f"~{need:,.0f} tokens (extrapolated)" if need else "no finite point (flat fit)"))
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for source in dict.fromkeys(p["source"] for p in points):
        ps = sorted((p for p in points if p["source"] == source), key=lambda p: p["train_tokens"])
        x = [p["train_tokens"] for p in ps]
        axes[0].plot(x, [p["tau"] for p in ps], "o-", label=source)
        axes[1].plot(x, [p["verify_speedup"] for p in ps], "o-", label=source)
    axes[0].axhline(TARGET_TAU, ls="--", c="gray", lw=1, label=f"target {TARGET_TAU}")
    axes[1].axhline(1.4, ls="--", c="gray", lw=1, label="target 1.4x")
    axes[1].axhline(1.0, ls=":", c="gray", lw=1)
    for ax, what in zip(axes, ("decode tau (verify)", "verify speedup vs HF generate"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel(what)
        ax.legend()
    fig.suptitle("heads vs training data (same recipe, same steps)")
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/scaling")
    ap.add_argument("--fractions", default="0.25,0.5,1")
    ap.add_argument("--sources", default="labelled,distilled")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts decoded per point")
    args, overrides = ap.parse_known_args(argv)
    from data_prep.stages import run_prep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for source in args.sources.split(","):
        for stage in ("all", "cache"):  # data and distillation, then this source's own cache (each skipped
            run_prep(_cfg([*overrides, f"train.data_use={source}", f"stage={stage}",  # when up to date)
                           f"paths.output_dir={out}"]))
        for f in (float(x) for x in args.fractions.split(",")):
            points.append(run_point(out, source, f, args.prompts, overrides))
    fits = {s: log_fit([p for p in points if p["source"] == s]) for s in dict.fromkeys(p["source"] for p in points)}
    write_outputs(out, points, fits)
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    sys.exit(main(sys.argv[1:]))
