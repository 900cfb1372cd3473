"""Batches of similar length (train.length_window) against random batches, side by side in one run.

    python bench/length_batches.py experiment=smollm2_demo             # after `make demo` (its cache)
    python bench/length_batches.py experiment=smollm2_demo --steps 48 --rounds 3
    python bench/length_batches.py backbone=tiny --steps 4 --rounds 1  # smoke run

For each setting (window 0 = random batches, and train.length_window) the same number of training
steps (forward, loss, backward, optimizer) from the start of epoch 0 are timed, in interleaved
rounds with the order alternating. Both orders hold the same rows per step; what differs is the
padding. Prints the CPU, the padded slots per real token over the whole epoch, seconds per step
(median and min-max over rounds) and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from mtp_train.cli.common import compose_config


def padded_slots(lengths: list[int], order: list[int], batch: int) -> tuple[int, int]:
    """(slots of right-padded batches, real tokens) over an epoch in `order`."""
    slots = sum(len(b) * max(lengths[i] for i in b)
                for b in (order[s:s + batch] for s in range(0, len(order), batch)))
    return slots, sum(lengths[i] for i in order)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="timed steps per setting and round")
    ap.add_argument("--rounds", type=int, default=3)
    args, overrides = ap.parse_known_args(argv)
    # first: it puts the hub offline; the demo's recipe unless another experiment is named
    cfg = compose_config(["experiment=smollm2_demo", "paths.output_dir=outputs/bench", *overrides])
    from data_prep.stages import run_prep
    from mtp_train import layout
    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import open_cache
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.heads.persist import build_heads
    from mtp_train.lit.data import MTPDataModule
    from mtp_train.lit.module import MTPHeadsModule
    from mtp_train.pipeline.training import draft_vocab_for

    run_prep(dataclasses.replace(cfg, stage="all"))  # skips itself when up to date
    backbone = load_backbone(cfg.backbone)
    cache, draft_ids = open_cache(cfg, backbone), draft_vocab_for(cfg, backbone)
    window = cfg.train.length_window if cfg.train.length_window > 1 else 16
    settings = {}
    for w in (0, window):
        torch.manual_seed(cfg.seed)
        heads = build_heads(cfg.heads, backbone, draft_ids=draft_ids)
        module = MTPHeadsModule(backbone, heads, cfg.loss, cfg.train)
        module.log = lambda *a, **k: None  # outside a Trainer
        dm = MTPDataModule(layout.data_dirs(cfg), backbone.tokenizer.pad_token_id or 0, cfg.train.batch_size,
                           layout.max_length(cfg), seed=cfg.seed, cache=cache, length_window=w)
        dm.setup()
        loader = dm.train_dataloader()
        order = list(dm.sampler)
        slots, real = padded_slots(dm.train_lengths, order, cfg.train.batch_size)
        batches = [b for _, b in zip(range(args.steps + 1), loader, strict=False)]
        opt = torch.optim.AdamW(heads.parameters(), lr=cfg.train.lr)
        settings[w] = {"module": module, "opt": opt, "batches": batches, "pad": slots / real, "s": []}

    def step(s: dict, batch: dict) -> None:
        loss = s["module"].model_step(batch, "train")
        s["opt"].zero_grad()
        loss.backward()
        s["opt"].step()

    def run(s: dict) -> float:
        t0 = time.perf_counter()
        for b in s["batches"][1:]:
            step(s, b)
        return (time.perf_counter() - t0) / (len(s["batches"]) - 1)

    for s in settings.values():  # warm-up: each setting's first batch, untimed
        step(s, s["batches"][0])
    for r in range(args.rounds):
        for w in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
            settings[w]["s"].append(run(settings[w]))
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; {cfg.backbone.name}, heads {cfg.heads.type} "
          f"k={cfg.heads.k}, batch {cfg.train.batch_size} rows <= {layout.max_length(cfg)} tokens, "
          f"{args.steps} steps x {args.rounds} interleaved rounds")
    med = {}
    for w, s in settings.items():
        med[w] = statistics.median(s["s"])
        name = "random batches" if w == 0 else f"length_window={w}"
        print(f"  {name:<20} padded slots per token (epoch) {s['pad']:.2f}   s/step {med[w]:.3f} "
              f"({min(s['s']):.3f}-{max(s['s']):.3f})")
    print(f"  step time ratio (random / grouped): {med[0] / med[window]:.2f}x")
    return 0


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    raise SystemExit(main(sys.argv[1:]))
