"""The head families side by side at one budget: chained vs eagle3 vs medusa, each trained with the same
recipe (experiment=smollm2_demo unless overridden) and decoded on the same unseen prompts.

    python bench/families.py                                   # the demo's budget, ~45 min on 2 cores
    python bench/families.py --families eagle3,chained --out runs/families trainer.max_steps=500

Per family: `mtp-prep stage=cache` (EAGLE-3's cache also holds its three layers), `mtp-train` into
<out>/<family>/train (skipped when finished), `mtp-eval` in modes verify (the chain of k drafts) and
tree into <out>/<family>/eval, each against HF generate in its own run. Prints and writes
<out>/families.{json,md}: val sim_tau, per-depth agreement, decode tau and speedup per mode, the CPU.
Needs the prepared data (`make demo`, or `mtp-prep experiment=smollm2_demo stage=all`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from mtp_train.cli.common import compose_config as config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="chained,eagle3,medusa")
    ap.add_argument("--out", type=Path, default=Path("runs/families"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every family (default experiment=smollm2_demo)")
    args = ap.parse_args(argv)
    from data_prep.stages import run_prep
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.pipeline.evaluation import run_eval
    from mtp_train.pipeline.training import run_train

    base = args.overrides or ["experiment=smollm2_demo"]
    if not any(o.startswith("experiment=") for o in base):
        base = ["experiment=smollm2_demo", *base]
    rows = {}
    for fam in args.families.split(","):
        train_dir, eval_dir = (args.out / fam / "train").resolve(), (args.out / fam / "eval").resolve()
        cfg = config([*base, f"heads={fam}", f"paths.output_dir={train_dir}"])
        run_prep(dataclasses.replace(cfg, stage="cache"))
        run_train(cfg)
        report = run_eval(config([*base, f"heads={fam}", f"paths.output_dir={eval_dir}", f"eval.train_run={train_dir}",
                                  "eval.modes=[verify,tree]", "eval.prompt_source=unseen"]))
        meta = json.loads((train_dir / "heads.json").read_text())
        m = meta["metrics"]
        k = meta["k"]
        rows[fam] = {"sim_tau": m["val/sim_tau"], "sim_tau_tree": m.get("val/sim_tau_tree"),
                     "agree": [m[f"val/agree_d{j}"] for j in range(1, k + 1)],
                     "steps": (meta.get("recipe") or {}).get("steps"),
                     **{f"{mode}_{key}": report["modes"][mode][key] for mode in ("verify", "tree")
                        for key in ("tau", "speedup_vs_hf", "identical_to_greedy")}}
    cpu = cpu_model()
    lines = [f"CPU: {cpu}; {' '.join(base)}", "",
             "| heads | val sim_tau | val tree tau | agreement d1/d2/d3 | chain tau | chain speedup | tree tau | tree speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for fam, r in rows.items():
        lines.append(f"| {fam} | {r['sim_tau']:.3f} | {r['sim_tau_tree']:.3f} | "
                     f"{' / '.join(f'{a:.3f}' for a in r['agree'])} | {r['verify_tau']:.2f} | "
                     f"{r['verify_speedup_vs_hf']:.2f}x | {r['tree_tau']:.2f} | {r['tree_speedup_vs_hf']:.2f}x |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "families.json").write_text(json.dumps({"cpu": cpu, "overrides": base, "rows": rows}, indent=2))
    (args.out / "families.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
