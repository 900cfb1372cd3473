"""Decoding speed: chain and tree verification against HF `generate` greedy, same prompts, same process.

    python bench/decode.py eval.train_run=runs/demo/train [hydra overrides...]
    python bench/decode.py eval.train_run=runs/demo/train "eval.modes=[greedy,verify,tree,dynamic,adaptive]"

Defaults: 20 prompts the project has never seen (`eval.prompt_source=unseen`: conversations of the
data source that the data stage did not sample), 128 new tokens, 3 interleaved timing rounds, modes
greedy, verify (the chain of k drafts) and tree (the static tree the measured costs favour).

Prints the CPU model, the dtype, the matmul layout chosen per weight, this machine's verify cost
curve, the candidate trees (predicted tau, verify and drafting cost) and per mode: tokens/s, speedup
against HF generate in the same dtype (median and spread over rounds) and against the faster of fp32
and bf16 HF generate, tau and per-depth acceptance; then checks the tree goals of
mtp_train/goals.py: tree tau over the chain's, the tree's speedup against HF in the same dtype and
against the faster HF with output identical to greedy, and the share of tau / cost(tree) the decoder
keeps. Writes eval_report.json and the plots into outputs/bench_decode/ (or paths.output_dir). The
demo's recipe and data (experiment=smollm2_demo) unless another experiment is named.
"""

from __future__ import annotations

import dataclasses
import sys

from mtp_train.cli.common import compose_config
from mtp_train.goals import DEMO as GOALS

DEFAULTS = ["experiment=smollm2_demo", "paths.output_dir=outputs/bench_decode", "logger=none",
            "eval.prompt_source=unseen", "eval.n_prompts=20", "eval.max_new_tokens=128", "eval.rounds=3", "eval.modes=[greedy,verify,tree]"]


def target_lines(report: dict) -> list[tuple[str, bool]]:
    """(line, met) for each target the report can be checked against."""
    modes, out = report["modes"], []
    trees = (report.get("decoder") or {}).get("trees") or {}
    if "tree" in modes and "verify" in modes:
        t, c = modes["tree"], modes["verify"]
        gain = GOALS["tree_tau_gain"]
        out.append((f"tree tau {t['tau']:.2f} >= chain tau {c['tau']:.2f} + {gain}", t["tau"] >= c["tau"] + gain))
    if "tree" in modes:
        t = modes["tree"]
        ok = t["identical_to_greedy"] is not False
        want = GOALS["tree_speedup"]
        out.append((f"tree {t['speedup_vs_hf']:.2f}x HF generate (same dtype) >= {want}x", t["speedup_vs_hf"] >= want))
        best = t.get("speedup_vs_best_hf")
        if best is not None:
            want = GOALS["tree_best_speedup"]
            out.append((f"tree {best:.2f}x the faster HF generate >= {want}x", best >= want))
        out.append((f"tree output identical to greedy: {t['identical_to_greedy']}", ok))
        row = next((r for r in trees.get("candidates", []) if r["label"] == trees.get("static")), None)
        if row:
            bound, share = t["tau"] / row["verify_cost"], GOALS["tree_bound_share"]
            out.append((f"tree keeps {t['speedup_vs_hf'] / bound:.0%} of tau / cost(tree) = "
                        f"{t['tau']:.2f} / {row['verify_cost']:.2f} = {bound:.2f}x (>= {share:.0%})",
                        t["speedup_vs_hf"] >= share * bound))
    return out


def main(overrides: list[str]) -> None:
    from data_prep.stages import run_prep
    from mtp_train.pipeline.evaluation import run_eval

    cfg = compose_config([*DEFAULTS, *overrides])
    if not cfg.eval.prompts:  # held-out prompts come from the prepared data (skips itself when up to date)
        run_prep(dataclasses.replace(cfg, stage="data"))
    report = run_eval(cfg)
    modes, dec = report["modes"], report.get("decoder") or {}
    hf = modes["hf_generate"]
    mach = report.get("machine") or {}
    print(f"\nCPU: {mach.get('cpu')} ({mach.get('threads')} threads, native bf16: {mach.get('native_bf16')})")
    print(f"backbone {report['backbone']}, dtype {dec.get('dtype')}, k={report['k']}, {hf['n_prompts']} prompts "
          f"({report.get('prompt_source')}), {report['max_new_tokens']} new tokens, {report.get('rounds')} rounds")
    print(f"matmul layout (row buckets 1..128, L = F.linear, T = W @ x^T, P = packed): {dec.get('matmul_layout')}")
    curve = dec.get("verify_costs") or {}
    if curve:
        print(f"verify cost, n tokens / 1 token ({curve['one_token_ms']:.1f} ms): "
              + ", ".join(f"{n}: {c:.2f}" for n, c in curve["costs"].items()))
    trees = dec.get("trees") or {}
    for r in trees.get("candidates", []):
        tau = "-" if r["predicted_tau"] is None else f"{r['predicted_tau']:.2f}"
        print(f"  {r['label']:8s} predicted tau {tau}  verify {r['verify_cost']:.2f} + draft "
              f"{r['draft_cost']:.2f} = {r['cost']:.2f}")
    print(f"tree: {trees.get('static')}, dynamic: {trees.get('dynamic')}; HF generate tokens/s by dtype: "
          f"{ {d: round(v, 1) for d, v in (report.get('hf_dtypes') or {}).items()} }")
    print(f"HF generate greedy: {hf['tokens_per_s']:.1f} tokens/s")
    for name, m in modes.items():
        if name == "hf_generate":
            continue
        d = report["details"][name]
        lo, hi = d.get("speedup_spread") or (m["speedup_vs_hf"],) * 2
        acceptance = " ".join(f"{a:.2f}" for a in m["acceptance"] if a is not None)
        best = m.get("speedup_vs_best_hf")
        print(f"{name:9s} {m['tokens_per_s']:6.1f} tok/s  {m['speedup_vs_hf']:.2f}x HF ({lo:.2f}-{hi:.2f})"
              f"  {'-' if best is None else f'{best:.2f}'}x best HF  tau {m['tau']:.2f}  acceptance [{acceptance}]"
              f"  identical_to_greedy {m['identical_to_greedy']}")
    for line in report.get("flags") or []:
        print(f"flag: {line}")
    for line in report.get("divergence") or []:
        print(f"not identical to greedy: {line}")
    for line, met in target_lines(report):
        print(f"target {'met' if met else 'NOT met'}: {line}")


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    main(sys.argv[1:])
