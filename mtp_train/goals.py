"""The speed and quality goals the project measures itself against, defined once: mtp-report's
goal table (mtp_train/report.py) and the benchmarks (bench/decode.py, bench/scaling.py,
bench/long_run.py) read them from here. Plain numbers: no torch, no Hydra.

Speedups are against HF `generate` greedy on the same prompts and machine; tau is the mean
accepted length (tokens per decoding step).
"""

from __future__ import annotations

# `make demo`: SmolLM2-135M-Instruct on prompts the project never saw, on a CPU
DEMO = {
    "verify_speedup": 1.4,  # verify (lossless): speedup, with output identical to greedy
    "verify_tau": 1.9,
    "tree_speedup": 1.5,  # tree (lossless): speedup against HF generate in the same dtype
    "tree_best_speedup": 1.2,  # ... and against the faster of HF generate's dtypes
    "tree_tau": 2.2,
    "tree_tau_gain": 0.4,  # tree tau over the chain's (verify's)
    "tree_bound_share": 0.8,  # of tau / cost(tree), the speedup the tree's measured cost allows
    "clp_speedup": 1.4,  # clp: speedup within its calibration bounds (repetition, NLL)
    "minutes": 30.0,  # the whole demo, from preparation to the report, on 2 cores
}

# bench/long_run.py (experiment=smollm2_cpu_long): the heads at its last, largest point
LONG_RUN = {
    "agree_d1": 0.5,  # depth-1 agreement with the backbone on validation positions
    "tree_speedup": 2.0,
    "clp_speedup": 1.2,
}
