"""Recipe comparison: the same data, steps and batches for each candidate recipe; validation sim_tau
(greedy verification's and speculative sampling's at T=1), per-depth agreement and wall time side
by side (the table behind the demo's choice, docs/results.md).

    python bench/recipes.py                           # the demo's data and cache, 80 steps a recipe
    python bench/recipes.py --steps 200 --out runs/recipes_200
    python bench/recipes.py --only kl_random,medusa_kl backbone=tiny   # any Hydra override after the flags
    python bench/recipes.py --minutes 4 --steps 5000 --only demo,noise0.1,rows8   # equal CPU minutes

Each recipe trains in <out>/<name>/ (a rerun skips finished ones: mtp-train's own recipe check).
Writes <out>/recipes.{json,md} and prints the table, best first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from mtp_train import layout
from mtp_train.cli.common import compose_config

# name -> overrides on top of the demo experiment
RECIPES = {
    "kl_random": ["loss=kl", "heads.init=random"],
    "kl_random_lr3e-3": ["loss=kl", "heads.init=random", "train.lr=3e-3"],
    "e2e_tv_random": ["loss=e2e_tv", "heads.init=random"],
    "kl_copy_last": ["loss=kl", "heads.init=copy_last"],
    "kl_copy_last_lr3e-3": ["loss=kl", "heads.init=copy_last", "train.lr=3e-3"],
    "ce_copy_last": ["loss=ce", "heads.init=copy_last"],
    "e2e_tv_copy_last": ["loss=e2e_tv", "heads.init=copy_last"],
    "medusa_kl_lr3e-3": ["heads=medusa", "loss=kl", "train.lr=3e-3"],
    # the options compared, each on top of the demo's recipe (chained, KL, random init)
    "kl_then_e2e_tv": ["loss=kl", "loss.schedule.then=e2e_tv", "loss.schedule.at=0.5"],
    "kl_topk8": ["loss=kl", "loss.topk=8", "loss.topk_weight=0.5"],
    "kl_depth_weights": ["loss=kl", "loss.depth_weights=[1.0,0.8,0.6]"],
    "kl_wsd": ["loss=kl", "train.lr_schedule=wsd"],
    "kl_lr2e-3_wd0.05": ["loss=kl", "train.lr=2e-3", "train.weight_decay=0.05"],
    # the seed papers' claims (docs/claims.md), on the demo's recipe (KL + top-K, random init)
    "ce": ["loss=ce", "loss.topk=0"],
    "kl": ["loss=kl", "loss.topk=0"],
    "e2e_tv": ["loss=e2e_tv", "loss.topk=0"],
    "ce_adamtp": ["loss=ce", "loss.topk=0", "loss.adamtp=true"],
    "kl_adamtp": ["loss=kl", "loss.topk=0", "loss.adamtp=true"],
    "e2e_tv_adamtp": ["loss=e2e_tv", "loss.topk=0", "loss.adamtp=true"],
    "k2": ["heads.k=2"],
    "k4": ["heads.k=4"],
    # more learning per CPU minute (issue: heads per CPU minute), on the demo's recipe: run with --minutes
    "demo": [],
    "noise0.1": ["train.feature_noise=0.1"],
    "noise0.3": ["train.feature_noise=0.3"],
    "lr2e-3": ["train.lr=2e-3"],
    "lr3e-3_warm50": ["train.lr=3e-3", "train.warmup_steps=50"],
    "rows8": ["train.batch_size=8"],
    "rows2": ["train.batch_size=2"],
    "vocab16k": ["heads.draft_vocab=16384"],
    "bf16": ["trainer.precision=bf16-mixed"],
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/recipes")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--minutes", type=float, default=None,
                    help="equal CPU minutes instead of equal steps: each recipe trains to this time budget "
                         "(train.time_budget_min; validation only at the end), --steps is then the cap")
    ap.add_argument("--only", default=None, help="comma-separated recipe names (default: all)")
    args, overrides = ap.parse_known_args(argv)
    from data_prep.stages import run_prep
    from mtp_train.artifacts import write_json_atomic
    from mtp_train.pipeline.training import run_train

    names = args.only.split(",") if args.only else list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        ap.error(f"unknown recipe(s) {unknown}; known: {', '.join(RECIPES)}")
    out = Path(args.out)
    rows = []
    for name in names:
        run = out / name
        length = ([f"train.time_budget_min={args.minutes}", "train.min_steps=10", f"trainer.val_check_interval={args.steps}"]
                  if args.minutes else [f"trainer.val_check_interval={max(1, args.steps // 2)}"])
        cfg = compose_config([
            "experiment=smollm2_demo", "logger=csv", *overrides, *RECIPES[name], f"trainer.max_steps={args.steps}",
            *length, f"paths.output_dir={run}"])
        run_prep(dataclasses.replace(cfg, stage="all"))  # skips itself when up to date
        metrics = run_train(cfg)
        meta = json.loads((run / layout.HEADS_META).read_text())
        rows.append({"recipe": name, "overrides": RECIPES[name], "sim_tau": metrics["val/sim_tau"],
                     "sim_tau_t1.0": metrics.get("val/sim_tau_t1.0"),  # speculative sampling's, at T=1
                     "agree": [metrics.get(f"val/agree_d{j}") for j in range(1, meta["k"] + 1)],
                     "acc": [metrics.get(f"val/acc_d{j}") for j in range(1, meta["k"] + 1)],
                     "alpha": [metrics.get(f"val/alpha_d{j}") for j in range(1, meta["k"] + 1)],
                     "train_s": meta["run"]["elapsed_s"], "steps": meta["recipe"]["steps"],
                     "train_tokens": meta["recipe"]["train_tokens"]})
    rows.sort(key=lambda r: -r["sim_tau"])
    from mtp_train.evaluation.machine import cpu_line

    each = f"{args.minutes} CPU minutes" if args.minutes else f"{args.steps} steps"
    lines = [f"{each} each on {rows[0]['train_tokens']:,} training tokens; CPU: {cpu_line()}",
             "", "| recipe | overrides | val sim_tau | val sim_tau_t1.0 | agree per depth | accuracy per depth | "
             "alpha per depth | steps | train wall |", "|---|---|---|---|---|---|---|---|---|"]
    per_depth = lambda xs: " / ".join("-" if a is None else f"{a:.3f}" for a in xs)  # noqa: E731
    lines += [f"| {r['recipe']} | `{' '.join(r['overrides'])}` | {r['sim_tau']:.3f} | "
              f"{per_depth([r['sim_tau_t1.0']])} | {per_depth(r['agree'])} | "
              f"{per_depth(r['acc'])} | {per_depth(r['alpha'])} | {r['steps']} | {r['train_s']:.0f} s |" for r in rows]
    write_json_atomic(out / "recipes.json", rows)
    (out / "recipes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    sys.exit(main(sys.argv[1:]))
