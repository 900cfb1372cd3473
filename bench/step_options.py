"""Training-step options timed side by side where the code runs: float32, bf16 autocast (what
trainer.precision=bf16-mixed does on a CPU), torch.compile of the heads, and both.

    python bench/step_options.py [--rounds 3] [--steps 6] [--options fp32,bf16,compile,bf16+compile]
                                 [--profile] [--roofline] [hydra overrides...]   # run where `mtp-prep` ran
    python bench/step_options.py backbone=tiny                      # smoke run

The same batches (from the demo's cache, the length-windowed order training uses) go through a
whole training step under each option (mtp_train/lit/step_options.py: rotating order per round,
the same initial heads, the first step untimed; for compile that is the compile, printed apart). Prints the CPU (family, model, vector flags), train tokens/s per option
(median over rounds, min-max) and the ratio to float32, and with --profile the heaviest operators
of one float32 step. --roofline counts a step's floating-point operations (torch's FlopCounterMode,
forward and backward: the matmuls and attention) and prints each option's GFLOP/s beside what one
plain matmul of the draft LM head's shape reaches here in the same dtype: how far a faster step
could still go on this CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from mtp_train.cli.common import compose_config


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--options", default="fp32,bf16,compile,bf16+compile")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--roofline", action="store_true")
    args, overrides = ap.parse_known_args(argv)
    cfg = compose_config(["experiment=smollm2_demo", "paths.output_dir=outputs/bench", *overrides])
    from data_prep.stages import run_prep
    from mtp_train import layout
    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import open_cache
    from mtp_train.evaluation.machine import cpu_line
    from mtp_train.heads.persist import build_heads
    from mtp_train.layout import data_dirs
    from mtp_train.lit.data import MTPDataModule
    from mtp_train.lit.module import MTPHeadsModule
    from mtp_train.lit.step_options import time_options
    from mtp_train.pipeline.training import draft_vocab_for

    run_prep(dataclasses.replace(cfg, stage="cache"))
    backbone = load_backbone(cfg.backbone)
    cache = open_cache(cfg, backbone)
    draft_ids = draft_vocab_for(cfg, backbone)
    dm = MTPDataModule(data_dirs(cfg), backbone.tokenizer.pad_token_id or 0, cfg.train.batch_size,
                       layout.max_length(cfg), seed=cfg.seed, cache=cache, k=cfg.heads.k,
                       length_window=cfg.train.length_window, vocab_size=backbone.vocab_size)
    dm.setup()
    batches = [b for _, b in zip(range(args.steps + 1), dm.train_dataloader(), strict=False)]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[1:])
    torch.manual_seed(cfg.seed)
    initial = build_heads(cfg.heads, backbone, draft_ids=draft_ids)
    options = args.options.split(",")
    timed = time_options(backbone, initial, cfg.loss, cfg.train, batches, options, args.rounds)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        module = MTPHeadsModule(backbone, initial, cfg.loss, cfg.train)
        module.log = lambda *a, **k: None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            module.model_step(batches[1], "train").backward()
    print(f"CPU: {cpu_line()}; torch {torch.__version__}")
    print(f"{cfg.backbone.name}, heads {cfg.heads.type} k={cfg.heads.k}, draft vocabulary "
          f"{cfg.heads.draft_vocab or 'full'}, loss {cfg.loss.name}, batch {cfg.train.batch_size} rows, "
          f"{args.steps} timed steps ({tokens:,} tokens) x {args.rounds} rounds, options in rotating order")
    per_round = {n: v["round_s"] for n, v in timed.items()}
    base = statistics.median(per_round[options[0]])
    print(f"{'option':<14} {'tokens/s median (min-max)':<28} {'s/step':>7} {'vs ' + options[0]:>9} {'first step':>11}")
    for name in options:
        secs = per_round[name]
        med = statistics.median(secs)
        print(f"{name:<14} {tokens / med:>8.0f} ({tokens / max(secs):.0f}-{tokens / min(secs):.0f}){'':<12} "
              f"{med / args.steps:>7.3f} {base / med:>8.2f}x {timed[name]['first_s']:>10.1f}s")
    if args.profile:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    if args.roofline:
        roofline(cfg, backbone, initial, batches, per_round, args.steps, options)


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """The best of `repeats` of one [m, k] @ [k, n] matmul in `dtype`, as GFLOP/s."""
    import time

    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up
    best = min(_timed(lambda: a @ b, time.perf_counter) for _ in range(repeats))
    return 2 * m * k * n / best / 1e9


def _timed(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def roofline(cfg, backbone, heads, batches, per_round: dict, steps: int, options: list[str]) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from mtp_train.lit.module import MTPHeadsModule

    module = MTPHeadsModule(backbone, heads, cfg.loss, cfg.train)
    module.log = lambda *a, **k: None
    flops = 0
    for b in batches[1:]:
        counter = FlopCounterMode(display=False)
        with counter:
            module.model_step(b, "train").backward()
        flops += counter.get_total_flops()
    module.zero_grad(set_to_none=True)
    rows = sum(int(b["attention_mask"].sum()) for b in batches[1:]) // steps
    hidden, vocab = backbone.hidden_size, int(cfg.heads.draft_vocab or backbone.vocab_size)
    peak = {d: matmul_gflops(rows, hidden, vocab, getattr(torch, t)) for d, t in
            (("fp32", "float32"), ("bf16", "bfloat16"))}
    print(f"roofline: {flops / steps / 1e9:.1f} GFLOP a step (forward + backward, counted by FlopCounterMode); "
          f"a plain [{rows} x {hidden}] @ [{hidden} x {vocab}] matmul reaches {peak['fp32']:.0f} GFLOP/s in "
          f"float32, {peak['bf16']:.0f} in bf16 here")
    for name in options:
        rate = flops / statistics.median(per_round[name]) / 1e9
        ref = peak["bf16" if "bf16" in name else "fp32"]
        print(f"  {name:<14} {rate:>6.0f} GFLOP/s = {rate / ref:.0%} of that matmul's")


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    main(sys.argv[1:])
