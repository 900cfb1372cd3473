"""Training-step options timed side by side where the code runs: float32, bf16 autocast (what
trainer.precision=bf16-mixed does on a CPU), torch.compile of the heads, and both.

    python bench/step_options.py [--rounds 3] [--steps 6] [--options fp32,bf16,compile,bf16+compile]
                                 [--profile] [hydra overrides...]   # run where `mtp-prep` ran
    python bench/step_options.py backbone=tiny                      # smoke run

The same batches (from the demo's cache, the length-windowed order training uses) go through a
whole training step under each option (mtp_train/lit/step_options.py: rotating order per round,
the same initial heads, the first step untimed; for compile that is the compile, printed apart). Prints the CPU (family, model, vector flags), train tokens/s per option
(median over rounds, min-max) and the ratio to float32, and with --profile the heaviest operators
of one float32 step.
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


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    main(sys.argv[1:])
