"""Decoding speed: every mode against HF `generate` greedy, same prompts, same process.

    python bench/decode.py eval.heads=runs/demo/train [hydra overrides...]
    python bench/decode.py eval.heads=runs/demo/train eval.modes=[greedy,verify,relaxed,adaptive]

Prints per mode: tokens/s, speedup vs HF generate, tau and per-depth acceptance, and checks the
decoder's own targets: greedy >= 1.0x HF generate, verify identical to greedy, and verify's speedup
against 0.8 x tau / step_cost (what is left when drafting and bookkeeping lose 20% of what the
accepted tokens buy). Writes the usual eval_report.json into outputs/bench_decode/.
"""

from __future__ import annotations

import sys

from hydra import compose, initialize_config_dir

from mtp_train.cli.common import CONF_DIR
from mtp_train.config import validate


def main(overrides: list[str]) -> None:
    from mtp_train.cli.eval import run_eval

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(compose("config", overrides=["paths.output_dir=outputs/bench_decode", "logger=none",
                                                    *overrides]))
    report = run_eval(cfg)
    modes = report["modes"]
    hf = modes["hf_generate"]
    print(f"\nbackbone {report['backbone']}, k={report['k']}, {hf['n_prompts']} prompts, "
          f"{report['max_new_tokens']} new tokens, step cost (k+1 tokens / 1) {report['step_cost']:.2f}")
    print(f"HF generate greedy: {hf['tokens_per_s']:.1f} tokens/s")
    for name, m in modes.items():
        if name == "hf_generate":
            continue
        alpha = " ".join(f"{a:.2f}" for a in m["alpha"] if a is not None)
        print(f"{name:9s} {m['tokens_per_s']:6.1f} tok/s  {m['speedup_vs_hf']:.2f}x HF  tau {m['tau']:.2f}"
              f"  alpha [{alpha}]  identical_to_greedy {m['identical_to_greedy']}")
    if "greedy" in modes:
        print(f"target greedy >= 1.0x HF: {modes['greedy']['speedup_vs_hf']:.2f}x")
    if "verify" in modes:
        v = modes["verify"]
        bound = 0.8 * v["tau"] / report["step_cost"]
        print(f"target verify >= 0.8 x tau / step_cost = {bound:.2f}x: {v['speedup_vs_hf']:.2f}x "
              f"({v['speedup_vs_hf'] / bound:.2f} of the bound)")


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    main(sys.argv[1:])
