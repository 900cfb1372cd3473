"""Frozen backbone against LoRA adapters trained with the heads, each with and without AdaMTP's mask:
where AdaMTP's claim lives (its mask keeps entropy-surge targets' gradients out of a backbone that
trains).

    python bench/lora.py                                    # the demo's recipe, 4 points
    python bench/lora.py --points frozen,lora --out runs/lora trainer.max_steps=120

Points: frozen (heads only), frozen_adamtp, lora (backbone.lora.enabled=true), lora_adamtp. Each is
trained into <out>/<point>/train (frozen points from the hidden-state cache, LoRA points with the
backbone live: the same rows and steps) and decoded on the same unseen prompts in modes verify and
tree against HF generate (for LoRA points both run the adapted backbone, and the report gives its
drift from the original). Writes <out>/lora.{json,md}: val sim_tau, agreement per depth, decode tau
and speedup, the drift, the train wall, the CPU. Needs the prepared data (`make demo`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from mtp_train.cli.common import compose_config as config

POINTS = {"frozen": [], "frozen_adamtp": ["loss.adamtp=true"],
          "lora": ["backbone.lora.enabled=true"],
          "lora_adamtp": ["backbone.lora.enabled=true", "loss.adamtp=true"]}


def run_point(name: str, base: list[str], out: Path) -> dict:
    from data_prep.stages import run_prep
    from mtp_train.pipeline.evaluation import run_eval
    from mtp_train.pipeline.training import run_train

    train_dir, eval_dir = (out / name / "train").resolve(), (out / name / "eval").resolve()
    over = [*base, *POINTS[name]]
    cfg = config([*over, f"paths.output_dir={train_dir}"])
    # each stage skips itself when up to date; LoRA points run the backbone live and need no cache
    for stage in ("data", "distill") if cfg.backbone.lora.enabled else ("all",):
        run_prep(dataclasses.replace(cfg, stage=stage))
    run_train(cfg)
    report = run_eval(config([*over, f"paths.output_dir={eval_dir}", f"eval.train_run={train_dir}",
                              "eval.modes=[verify,tree]", "eval.prompt_source=unseen"]))
    meta = json.loads((train_dir / "heads.json").read_text())
    m, k = meta["metrics"], meta["k"]
    drift = (report.get("backbone_adapted") or {}).get("drift")
    return {"overrides": POINTS[name], "sim_tau": m["val/sim_tau"], "sim_tau_tree": m.get("val/sim_tau_tree"),
            "agree": [m[f"val/agree_d{j}"] for j in range(1, k + 1)],
            "masked": [m.get(f"val/masked_d{j}") for j in range(1, k + 1)],
            "loss_distill": m.get("val/loss_distill"),
            "steps": (meta.get("recipe") or {}).get("steps"), "train_s": (meta.get("run") or {}).get("elapsed_s"),
            "drift": drift,
            **{f"{mode}_{key}": report["modes"][mode][key] for mode in ("verify", "tree")
               for key in ("tau", "speedup_vs_hf", "identical_to_greedy")},
            "hf_nll": report["modes"]["hf_generate"]["backbone_nll"]}


def table(rows: dict) -> list[str]:
    lines = ["| point | val sim_tau | agreement d1/d2/d3 | chain tau / speedup | tree tau / speedup | "
             "greedy answers = original's | original's NLL on its answers (+ increase) | train wall |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        d = r["drift"]
        drift = (f"{d['greedy_match_rate']:.2f} (prefix {d['prefix_match']:.2f})" if d else "1 (frozen)")
        nll = (f"{d['original_nll_on_adapted']:.3f} (+{d['nll_increase']:.3f})" if d else f"{r['hf_nll']:.3f}")
        lines.append(f"| {name} | {r['sim_tau']:.3f} | {' / '.join(f'{a:.3f}' for a in r['agree'])} | "
                     f"{r['verify_tau']:.2f} / {r['verify_speedup_vs_hf']:.2f}x | "
                     f"{r['tree_tau']:.2f} / {r['tree_speedup_vs_hf']:.2f}x | {drift} | {nll} | "
                     f"{(r['train_s'] or 0) / 60:.1f} min |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--out", type=Path, default=Path("runs/lora"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every point (default experiment=smollm2_demo)")
    args = ap.parse_args(argv)
    from mtp_train.evaluation.machine import cpu_model

    base = args.overrides or ["experiment=smollm2_demo"]
    if not any(o.startswith("experiment=") for o in base):
        base = ["experiment=smollm2_demo", *base]
    unknown = sorted(set(args.points.split(",")) - set(POINTS))
    if unknown:
        ap.error(f"--points: unknown {unknown}; choose from {', '.join(POINTS)}")
    rows = {name: run_point(name, base, args.out) for name in args.points.split(",")}
    cpu = cpu_model()
    text = "\n".join([f"CPU: {cpu}; {' '.join(base)}", "", *table(rows)])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.json").write_text(json.dumps({"cpu": cpu, "overrides": base, "rows": rows}, indent=2))
    (args.out / "lora.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
