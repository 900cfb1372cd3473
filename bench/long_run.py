"""The long run: how far the demo's recipe goes with more CPU time, as tau and speed against training
tokens, with the steps scaled in proportion to the data (more data and more steps together).

    python bench/long_run.py                                  # experiment=smollm2_cpu_long, ~2 h on 2 cores
    python bench/long_run.py --fractions 0.25,0.5,1 --out runs/long_run
    python bench/long_run.py experiment=smollm2_demo --fractions 0.5,1   # any Hydra override after the flags

Point f trains on the first fraction f of each training source (train.data_fraction) for
f x trainer.max_steps steps, fits and calibrates CLP on its heads, and decodes the same unseen prompts
in modes verify (the chain), tree and clp against HF generate in the same process. Every stage is
resumable and skips finished work, so a killed run continues where it stopped.
Writes <out>/long_run.{json,md,png}: per point training tokens, steps, validation agreement, chain and
tree tau, speedups, and CLP's speedup within its quality bounds; then the targets at the last point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from mtp_train import layout
from mtp_train.cli.common import compose_config
from mtp_train.goals import LONG_RUN as TARGETS  # the goals at the long run's last point


def _cfg(overrides: list[str]):
    return compose_config(["logger=csv", *overrides])


def run_point(out: Path, fraction: float, prompts: int, overrides: list[str], source: str = "unseen") -> dict:
    from mtp_train.clp import saved_threshold
    from mtp_train.pipeline.clp_run import run_clp
    from mtp_train.pipeline.evaluation import run_eval
    from mtp_train.pipeline.training import run_train
    from mtp_train.report import accepts_nothing

    base = _cfg([*overrides, f"paths.output_dir={out}"])
    steps = max(1, round(fraction * base.trainer["max_steps"]))
    run = out / f"f{fraction:g}"
    run_train(_cfg([*overrides, f"train.data_fraction={fraction}", f"trainer.max_steps={steps}",
                    f"trainer.val_check_interval={max(1, steps // 3)}", f"paths.output_dir={run}/train"]))
    run_clp(_cfg([*overrides, f"clp.train_run={run}/train", f"paths.output_dir={run}/clp"]))
    report = run_eval(_cfg([*overrides, f"eval.train_run={run}/train", f"eval.clp_run={run}/clp",
                            "eval.modes=[verify,tree,clp]", f"eval.prompt_source={source}",
                            f"eval.n_prompts={prompts}", f"paths.output_dir={run}/eval"]))
    heads = json.loads((layout.pipeline_dirs(run)[0] / layout.HEADS_META).read_text())
    modes = report["modes"]
    clp_meta = json.loads((layout.predictor_dir(layout.pipeline_dirs(run)[1], "clp") / layout.PREDICTOR_META).read_text())
    bounds, c, ref = clp_meta.get("bounds") or {}, modes["clp"], modes["hf_generate"]
    within = (c["repetition_ratio"] - ref["repetition_ratio"] <= bounds.get("max_repetition_increase", 0.02) + 1e-9
              and c["backbone_nll"] - ref["backbone_nll"] <= bounds.get("max_nll_increase", 0.1) + 1e-9)
    return {"fraction": fraction, "steps": heads["recipe"]["steps"], "train_rows": heads["recipe"]["train_rows"],
            "train_tokens": heads["recipe"]["train_tokens"], "train_s": heads["run"]["elapsed_s"],
            "sim_tau": heads["metrics"]["val/sim_tau"],
            "agree": [heads["metrics"].get(f"val/agree_d{j}") for j in range(1, heads["k"] + 1)],
            "chain_tau": modes["verify"]["tau"], "verify_speedup": modes["verify"]["speedup_vs_hf"],
            "tree_tau": modes["tree"]["tau"], "tree_speedup": modes["tree"]["speedup_vs_hf"],
            "tree": (report.get("decoder") or {}).get("trees", {}).get("static"),
            "identical": bool(modes["verify"]["identical_to_greedy"] and modes["tree"]["identical_to_greedy"]),
            "clp_speedup": modes["clp"]["speedup_vs_hf"], "clp_threshold": saved_threshold(clp_meta),
            "clp_calibrated": not accepts_nothing(report, "clp", {"clp": clp_meta}),
            "clp_within_bounds": within,
            "hf_tokens_per_s": modes["hf_generate"]["tokens_per_s"], "machine": report.get("machine")}


def table(points: list[dict]) -> list[str]:
    lines = ["| fraction | steps | rows | training tokens | train wall | val agree d1/d2/d3 | chain tau | tree tau "
             "(tree) | verify vs HF | tree vs HF | CLP vs HF (within bounds) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        clp = (f"{p['clp_speedup']:.2f}x ({'yes' if p['clp_within_bounds'] else 'no'}, threshold {p['clp_threshold']:.2f})"
               if p["clp_calibrated"] else f"{p['clp_speedup']:.2f}x (not calibrated: accepts nothing)")
        lines.append(f"| {p['fraction']:g} | {p['steps']} | {p['train_rows']} | {p['train_tokens']:,} | "
                     f"{p['train_s'] / 60:.0f} min | " + " / ".join(f"{a:.3f}" for a in p["agree"])
                     + f" | {p['chain_tau']:.2f} | {p['tree_tau']:.2f} ({p['tree']}) | {p['verify_speedup']:.2f}x | "
                     f"{p['tree_speedup']:.2f}x | {clp} |")
    return lines


def target_lines(last: dict) -> list[tuple[str, bool]]:
    clp_ok = last["clp_calibrated"] and last["clp_within_bounds"] and last["clp_speedup"] >= TARGETS["clp_speedup"]
    return [(f"depth-1 agreement {last['agree'][0]:.3f} >= {TARGETS['agree_d1']}", last["agree"][0] >= TARGETS["agree_d1"]),
            (f"tree {last['tree_speedup']:.2f}x HF generate >= {TARGETS['tree_speedup']}x, identical output",
             last["tree_speedup"] >= TARGETS["tree_speedup"] and last["identical"]),
            (f"CLP {last['clp_speedup']:.2f}x HF generate >= {TARGETS['clp_speedup']}x within its bounds "
             f"(calibrated: {last['clp_calibrated']}, within: {last['clp_within_bounds']})", clp_ok)]


def write_outputs(out: Path, points: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mtp_train.artifacts import write_json_atomic

    write_json_atomic(out / "long_run.json", {"points": points, "targets": TARGETS})
    lines = table(points)
    if points:
        lines += ["", "targets at the last point:"]
        lines += [f"- {'met' if ok else 'NOT met'}: {line}" for line, ok in target_lines(points[-1])]
    (out / "long_run.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    x = [p["train_tokens"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(x, [p["chain_tau"] for p in points], "o-", label="chain (verify)")
    axes[0].plot(x, [p["tree_tau"] for p in points], "s-", label="tree")
    axes[0].plot(x, [1 + sum(a for a in p["agree"] if a) for p in points], "^:", label="1 + sum of val agreement")
    axes[1].plot(x, [p["verify_speedup"] for p in points], "o-", label="verify")
    axes[1].plot(x, [p["tree_speedup"] for p in points], "s-", label="tree")
    axes[1].plot(x, [p["clp_speedup"] for p in points], "d-", label="clp")
    axes[1].axhline(TARGETS["tree_speedup"], ls="--", c="gray", lw=1, label=f"tree target {TARGETS['tree_speedup']}x")
    axes[1].axhline(1.0, ls=":", c="gray", lw=1)
    for ax, what in zip(axes, ("tau (accepted tokens per step)", "speedup vs HF generate"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("training tokens (steps in proportion)")
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    fig.suptitle("the long run: heads vs training data and steps")
    fig.tight_layout()
    fig.savefig(out / "long_run.png", dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/long_run")
    ap.add_argument("--fractions", default="0.25,0.5,1")
    ap.add_argument("--prompts", type=int, default=20, help="prompts decoded per point")
    ap.add_argument("--prompt-source", default="unseen", choices=["unseen", "validation"],
                    help="eval.prompt_source: conversations the data stage never took (default) or validation")
    args, overrides = ap.parse_known_args(argv)
    from data_prep.stages import run_prep

    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=smollm2_cpu_long", *overrides]
    cfg = _cfg([*overrides, f"paths.output_dir={args.out}/prep"])
    for stage in ("all", "cache"):
        run_prep(dataclasses.replace(cfg, stage=stage))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = [run_point(out, float(f), args.prompts, overrides, args.prompt_source)
              for f in args.fractions.split(",")]
    points.sort(key=lambda p: p["train_tokens"])
    write_outputs(out, points)
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    sys.exit(main(sys.argv[1:]))
