"""The data path's throughput, before and after, side by side in one run on the machine at hand.

    python bench/data_path.py [--rows 48] [--prompts 16] [--rounds 2] [hydra overrides...]

Run where `mtp-prep` ran (it reads the prepared labelled and distilled data). Prints the CPU model,
then, in interleaved rounds (median and min-max):
- cache: backbone tokens/s of the hidden-state cache build over the same `--rows` rows, the old way
  (row-order batches of 8 right-padded rows, stats from a float32 (B, T, V) logits tensor in five
  passes) and the new one (`length_batches` of similar length, fused stats in chunks of positions,
  `teacher.stats_from_hidden`), in float32 and, where
  the CPU has native bf16, in bfloat16 too;
- distill: answer tokens/s of self-distillation over `--prompts` prompts without and with the hidden
  states kept, and what the kept states save: the cache no longer runs the backbone over those rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mtp_train.cli.common import compose_config


@torch.no_grad()
def stats_before(logits: torch.Tensor) -> None:
    """The per-token stats as they were computed: logsumexp, then p, then a masked p * x."""
    rows = logits.reshape(-1, logits.shape[-1])
    chunk = max(1, (1 << 24) // rows.shape[-1])
    for s in range(0, rows.shape[0], chunk):
        x = rows[s: s + chunk].float()
        m = torch.logsumexp(x, dim=-1)
        p = torch.exp(x - m[:, None])
        (m - torch.where(p > 0, p * x, torch.zeros_like(p)).sum(-1), x.argmax(-1))


@torch.no_grad()
def cache_before(backbone, ids: list[list[int]]) -> None:
    """The cache build as it was: batches of 8 in row order, a (B, T, V) float32 logits tensor."""
    from data_prep.cache import right_pad

    for b in range(0, len(ids), 8):
        inp, attn = right_pad(ids[b: b + 8])
        h = backbone.hidden_states(inp, attn)
        stats_before(backbone.logits(h))


@torch.no_grad()
def cache_after(backbone, ids: list[list[int]], compute: str) -> None:
    from data_prep.cache import _hidden_rows, length_batches

    for batch in length_batches([len(x) for x in ids], 4096):
        _hidden_rows(backbone, [ids[i] for i in batch], "float16", compute)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main(argv: list[str]) -> int:
    import dataclasses

    from data_prep.distill import _generate_shard
    from mtp_train import layout
    from mtp_train.backbone import cpu_has_native_bf16, load_backbone
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.layout import distilled_dir, labelled_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48, help="rows the cache build runs over")
    ap.add_argument("--prompts", type=int, default=16, help="prompts distilled per variant")
    ap.add_argument("--rounds", type=int, default=2)
    args, overrides = ap.parse_known_args(argv)
    cfg = compose_config(["experiment=smollm2_demo", "paths.output_dir=outputs/bench", *overrides])
    from datasets import load_from_disk  # after compose_config, which puts the hub offline

    backbone = load_backbone(cfg.backbone)
    max_length = layout.max_length(cfg)
    rows = []
    for d in (labelled_dir(cfg), distilled_dir(cfg)):
        ds = load_from_disk(str(d))["train"]
        rows += [list(r)[:max_length] for r in ds.select(range(min(len(ds), args.rows // 2)))["input_ids"]]
    n_tok = sum(len(r) for r in rows)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, native bf16: {cpu_has_native_bf16()}")
    print(f"backbone {cfg.backbone.name}; cache over {len(rows)} rows, {n_tok:,} tokens "
          f"(rows cropped to {max_length}); {args.rounds} interleaved rounds")

    variants = {"before (fp32)": lambda: cache_before(backbone, rows),
                "after (fp32)": lambda: cache_after(backbone, rows, "float32")}
    if cpu_has_native_bf16() or backbone.device.type == "cuda":
        variants["after (bf16)"] = lambda: cache_after(backbone, rows, "bfloat16")
    cache_after(backbone, rows[:4], "float32")  # warm-up
    speed = {k: [] for k in variants}
    for r in range(args.rounds):
        names = list(variants)[r % len(variants):] + list(variants)[: r % len(variants)]
        for name in names:
            t0 = time.perf_counter()
            variants[name]()
            speed[name].append(n_tok / (time.perf_counter() - t0))
    print("cache build, backbone tokens/s (median, min-max):")
    for name, xs in speed.items():
        print(f"  {name:14s} {spread(xs)}   {statistics.median(xs) / statistics.median(speed['before (fp32)']):.2f}x")

    src = load_from_disk(str(labelled_dir(cfg)))["train"].select(range(args.prompts))
    dcfg = cfg.data.distill
    gen_speed = {False: [], True: []}
    kept_tokens = 0
    for r in range(args.rounds):
        for keep in ((False, True) if r % 2 == 0 else (True, False)):
            c = dataclasses.replace(dcfg, keep_states=keep, batch_size=min(dcfg.batch_size, args.prompts))
            t0 = time.perf_counter()
            records, _, n_new, states = _generate_shard(backbone.model, backbone.tokenizer, src, c,
                                                         cfg.data.max_length, backbone.device, seed=0)
            gen_speed[keep].append(n_new / (time.perf_counter() - t0))
            if keep:
                kept_tokens = sum(min(len(s[0]), max_length) for s in states)
    old_cache = statistics.median(speed["before (fp32)"])
    print(f"self-distillation over {args.prompts} prompts ({dcfg.max_new_tokens} new tokens at most), "
          "answer tokens/s:")
    print(f"  states dropped {spread(gen_speed[False])}")
    print(f"  states kept    {spread(gen_speed[True])}   "
          f"{statistics.median(gen_speed[True]) / statistics.median(gen_speed[False]):.2f}x")
    t_gen = {k: n_new / statistics.median(v) for k, v in gen_speed.items()}
    before = t_gen[False] + kept_tokens / old_cache
    print(f"  distill + cache of these rows: {before:.1f} s before (the cache's old speed), "
          f"{t_gen[True]:.1f} s with the states kept ({before / t_gen[True]:.2f}x; the cache then "
          f"copies their {kept_tokens:,} tokens' states)")
    return 0


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    sys.exit(main(sys.argv[1:]))
