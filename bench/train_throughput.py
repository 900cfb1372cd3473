"""Training throughput: the hidden-state cache vs the live backbone, side by side in one run.

    python bench/train_throughput.py [hydra overrides...]      # run where `mtp-prep` ran
    python bench/train_throughput.py backbone=tiny             # smoke run

Builds (or reuses) the cache for train.data_use, then times the same batches through one training
step (forward, loss, backward, optimizer) from the cache and with the live backbone. Prints tokens/s
for both, their ratio, the cache's bytes per token and the process's peak RSS.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time

import torch

from mtp_train.cli.common import compose_config


def main(overrides: list[str]) -> None:
    # first: it puts the hub offline; the demo's recipe unless another experiment is named
    cfg = compose_config(["experiment=smollm2_demo", "paths.output_dir=outputs/bench", *overrides])
    from data_prep.stages import run_prep
    from mtp_train import layout
    from mtp_train.backbone import load_backbone
    from mtp_train.data.cache import HiddenCache
    from mtp_train.data.prepared import cache_location
    from mtp_train.heads.persist import build_heads
    from mtp_train.layout import data_dirs
    from mtp_train.lit.data import MTPDataModule
    from mtp_train.lit.module import MTPHeadsModule
    from mtp_train.pipeline.training import draft_vocab_for

    n_batches = 4
    run_prep(dataclasses.replace(cfg, stage="cache"))
    backbone = load_backbone(cfg.backbone)
    _, path = cache_location(cfg, backbone)
    cache = HiddenCache(path, vocab_size=backbone.vocab_size)
    max_length = layout.max_length(cfg)
    draft_ids = draft_vocab_for(cfg, backbone)
    results = {}
    for name, c in (("cache", cache), ("live", None)):
        torch.manual_seed(0)
        heads = build_heads(cfg.heads, backbone, draft_ids=draft_ids)
        module = MTPHeadsModule(backbone, heads, cfg.loss, cfg.train)
        opt = torch.optim.AdamW(heads.parameters(), lr=cfg.train.lr)
        dm = MTPDataModule(data_dirs(cfg), backbone.tokenizer.pad_token_id or 0, cfg.train.batch_size,
                           max_length, cache=c)
        dm.setup()
        batches = [b for _, b in zip(range(n_batches + 1), dm.val_dataloader(), strict=False)]
        tokens, seconds = 0, 0.0
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            loss = module.model_step(batch, "train")
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i > 0:  # the first batch is warm-up
                seconds += time.perf_counter() - t0
                tokens += int(batch["attention_mask"].sum())
        results[name] = tokens / seconds
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"backbone {cfg.backbone.name}, heads {cfg.heads.type} k={cfg.heads.k} "
          f"(draft vocabulary {cfg.heads.draft_vocab or 'full'}), loss {cfg.loss.name}, "
          f"batch {cfg.train.batch_size} x <= {max_length} tokens, {n_batches} timed steps each")
    print(f"train tokens/s   cache {results['cache']:.0f}   live {results['live']:.0f}   "
          f"ratio {results['cache'] / results['live']:.2f}x")
    print(f"cache {cache.manifest['bytes_per_token']:.0f} bytes/token "
          f"({cache.manifest['tokens']:,} tokens), peak RSS {rss_gb:.2f} GB")


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    main(sys.argv[1:])
