"""Self-distillation through the serving engine against today's HF `generate` path, side by side.

    python bench/distill_engine.py [--prompts 32] [--rounds 2] [--max-num-seqs 8] [hydra overrides...]

The workload is the one `mtp-prep stage=distill` runs: the prepared data's train prompts (the
conversation up to its first answer), answered greedily with data.distill.max_new_tokens new
tokens. Timed in interleaved rounds, in a rotating order:

- `hf` and `hf_states`: data_prep.distill's own shard generator (HF `generate`, batches of
  data.distill.batch_size, longest first, data.distill.autocast), without and with the hidden
  states it keeps for the cache (what the demo runs);
- `engine_<dtype>`: vLLM's CPU build (mtp_train/engine/, its own venv) on the same prompt ids, all
  submitted at once, at most --max-num-seqs sequences in flight, in each of --dtypes.

Prints the CPU, tokens/s per path (median and spread over rounds), the engine's speed over HF's, and
how many answers the engine gave token for token as HF did (greedy: differences come from rounding,
batch shapes included; the first differing position is printed). The engine gives no hidden states:
a distillation through it would leave the cache stage a forward over every row that `hf_states`
saves. Writes the figures to outputs/bench_distill_engine/distill_engine.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's end counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the engine's sequences in flight")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="the engine's dtypes, comma-separated")
    args, overrides = parser.parse_known_args(argv)

    from mtp_train.cli.common import compose_config

    cfg = compose_config(["experiment=smollm2_demo", "logger=none",
                          "paths.output_dir=outputs/bench_distill_engine", *overrides])
    import torch
    from datasets import load_from_disk
    from jinja2 import TemplateError

    from data_prep.distill import _generate_shard, prompt_messages
    from data_prep.stages import run_prep
    from mtp_train.artifacts import write_json_atomic
    from mtp_train.backbone import cut_at_eos, eos_ids, load_backbone, resolve_autocast
    from mtp_train.data.template import render_prompt
    from mtp_train.engine import env as engine_env
    from mtp_train.engine.check import EngineWorker
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.evaluation.runner import round_order
    from mtp_train.layout import labelled_dir
    from mtp_train.pipeline.serving import backbone_for_serving

    flags = engine_env.check_cpu()
    python = engine_env.ensure_env()
    engine = engine_env.describe(python)
    run_prep(dataclasses.replace(cfg, stage="data"))
    backbone = load_backbone(cfg.backbone)
    serve_dir = backbone_for_serving(cfg.backbone)
    if serve_dir is None:
        raise SystemExit("this backbone is built in code: the engine needs a backbone directory")
    dcfg = cfg.data.distill
    tok = backbone.tokenizer
    rows = load_from_disk(str(labelled_dir(cfg)))["train"]
    rows = rows.select(range(min(args.prompts, len(rows))))
    prompts = []  # the prompt ids _generate_shard answers, in its row order
    for r in rows:
        try:
            ids = render_prompt(tok, prompt_messages(r["messages"]))
        except TemplateError:
            continue
        if len(ids) <= dcfg.max_prompt_tokens:
            prompts.append(ids)
    eos = eos_ids(backbone.model, tok)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    autocast = resolve_autocast(backbone.device, dcfg.autocast)
    huge = 10**9  # no truncation: the answers compare whole

    def hf(keep_states: bool):
        records = _generate_shard(backbone.model, tok, rows, dataclasses.replace(dcfg, keep_states=keep_states),
                                  huge, backbone.device, seed=0)[0]
        return [rec["input_ids"][len(p):] for rec, p in zip(records, prompts, strict=True)]

    spec = {"model": str(serve_dir), "max_tokens": dcfg.max_new_tokens, "eos": eos,
            "max_model_len": max(map(len, prompts)) + dcfg.max_new_tokens + 16, "max_num_seqs": args.max_num_seqs,
            "memory_fraction": 0.2, "engines": {f"engine_{d}": {"dtype": d} for d in dtypes}}
    names = ["hf", "hf_states", *spec["engines"]]
    secs = {n: [] for n in names}
    toks = {n: [] for n in names}
    answers: dict[str, list[list[int]]] = {}
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_model()} ({', '.join(sorted(flags))}); {engine['package']} (torch {engine['torch']}); "
          f"HF generate with autocast {autocast}, batch {dcfg.batch_size}; {len(prompts)} prompts x <= "
          f"{dcfg.max_new_tokens} new tokens, greedy; engine: <= {args.max_num_seqs} sequences in flight", flush=True)
    with torch.no_grad(), EngineWorker(python, spec, out_dir / "engine.log") as worker:
        for name in spec["engines"]:  # warm-up outside the timings
            worker.ask(op="generate_batch", engine=name, prompts=prompts[:2])
        for r in range(args.rounds):
            for name in round_order(names, 0, r):
                t0 = time.perf_counter()
                if name.startswith("hf"):
                    got = hf(name == "hf_states")
                    took = time.perf_counter() - t0
                else:
                    ans = worker.ask(op="generate_batch", engine=name, prompts=prompts)
                    got, took = ans["outputs"], ans["seconds"]
                got = [cut_at_eos(a, eos)[0] for a in got]
                secs[name].append(took)
                toks[name].append(sum(map(len, got)))
                answers.setdefault(name, got)
                print(f"  round {r + 1} {name:>16}: {toks[name][-1]} tokens in {took:.1f} s = "
                      f"{toks[name][-1] / took:.1f} tokens/s", flush=True)

    rates = {n: [t / s for t, s in zip(toks[n], secs[n], strict=True)] for n in names}
    result = {"cpu": cpu_model(), "cpu_flags": sorted(flags), "engine": engine, "autocast": autocast,
              "batch_size": dcfg.batch_size, "max_num_seqs": args.max_num_seqs, "n_prompts": len(prompts),
              "max_new_tokens": dcfg.max_new_tokens, "rounds": args.rounds, "paths": {}}
    print(f"\n{'path':>16} {'tokens/s (median, min-max)':>30} {'vs hf':>8} {'vs hf_states':>13} "
          f"{'answers = hf':>13} {'first diff (median)':>20}")
    for n in names:
        med = statistics.median(rates[n])
        diffs = [first_difference(a, b) for a, b in zip(answers[n], answers["hf"], strict=True)]
        same = sum(d is None for d in diffs)
        at = [d for d in diffs if d is not None]
        vs_hf = med / statistics.median(rates["hf"])
        vs_states = med / statistics.median(rates["hf_states"])
        result["paths"][n] = {"tok_s_median": med, "tok_s_rounds": rates[n], "vs_hf": vs_hf, "vs_hf_states": vs_states,
                              "answers_equal_hf": same, "first_difference_positions": at}
        print(f"{n:>16} {med:>10.1f} ({min(rates[n]):.1f}-{max(rates[n]):.1f}){'':>8} {vs_hf:>7.2f}x "
              f"{vs_states:>12.2f}x {same:>6}/{len(prompts):<6} "
              f"{(statistics.median(at) if at else '-'):>20}")
    write_json_atomic(out_dir / "distill_engine.json", result)
    print(f"\nwritten: {out_dir / 'distill_engine.json'}")


if __name__ == "__main__":  # the engine's worker is a separate process, but keep the guard as vLLM asks
    import logging

    logging.disable(logging.WARNING)
    main(sys.argv[1:])
