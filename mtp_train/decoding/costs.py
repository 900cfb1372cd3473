"""What this machine charges for a decoding step, measured on the decoder at hand: the matmul layout
per row count, the cost of verifying n tokens relative to one, the cost of drafting a tree."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from mtp_train.decoding.drafting import draft_tree
from mtp_train.decoding.kv import crop_to
from mtp_train.decoding.matmul import LAYOUTS, ROW_BUCKETS, MatmulPlan, can_pack, routed_linears
from mtp_train.trees import TreeShape


def measure_matmuls(dec, reps: int = 4, context: int = 128, buckets=ROW_BUCKETS) -> MatmulPlan:
    """For each row-count bucket, time a whole backbone forward of that many tokens (LM head
    included) with every linear in each layout of matmul.LAYOUTS (`F.linear`, `W @ x^T`, and
    oneDNN's packed weights where this CPU can pack them), interleaved in a rotating order, medians
    of `reps` after a warm-up round, and route that bucket through the fastest layout from now on
    (heads and draft projections included). The packed copies are kept only where chosen."""
    from transformers import DynamicCache

    mods = [m for m in (dec.backbone.model, dec.heads) if m is not None]
    weights = [lin.weight for m in mods for lin in m.modules() if type(lin) is nn.Linear]
    weights += [dec.weight] + ([dec.drafter.weight] if getattr(dec.drafter, "weight", None) is not None else [])
    keys = {MatmulPlan.key(w) for w in weights}
    layouts = [t for t in LAYOUTS if t != "P" or can_pack(dec.weight)]
    plans = {t: MatmulPlan({key: [t] * len(ROW_BUCKETS) for key in keys}) for t in layouts}
    chosen = ["L"] * len(ROW_BUCKETS)
    ids = torch.randint(0, dec.weight.shape[0], (context + max(buckets),),
                        generator=torch.Generator().manual_seed(0)).to(dec.device)
    with torch.inference_mode():
        cache = DynamicCache()
        dec.forward(ids[:context], cache)
        for i, rows in enumerate(ROW_BUCKETS):
            if rows not in buckets:
                continue
            times = {t: [] for t in layouts}
            for r in range(reps + 1):
                for t in layouts[r % len(layouts):] + layouts[: r % len(layouts)]:
                    with routed_linears(plans[t], *mods):
                        t0 = time.perf_counter()
                        out = dec.forward(ids[context: context + rows], cache)
                        plans[t].mm(out, dec.weight).argmax(-1)
                        dt = time.perf_counter() - t0
                    crop_to(cache, context)
                    if r:
                        times[t].append(dt)
            chosen[i] = min(layouts, key=lambda t: statistics.median(times[t]))
    dec.mm.choices.update({key: list(chosen) for key in keys})
    if "P" in chosen:  # keep the packed copies made while timing (each weight is packed once)
        dec.mm.adopt_packed(plans["P"])
    return dec.mm


def verify_costs(dec, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), context: int = 128,
                 rounds: int = 7, warmup: int = 2) -> dict:
    """Wall time of one backbone forward over n new tokens (plus the LM head and argmax) after
    `context` cached tokens, relative to n = 1: medians of `rounds` interleaved rounds (the order
    of sizes rotates per round) after `warmup` untimed ones. Returns {"costs": {n: ratio},
    "one_token_ms", "spread": {n: [min, max] ratio}}."""
    with dec.routing(), torch.inference_mode():
        from transformers import DynamicCache

        sizes = sorted(set(sizes) | {1})
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, dec.weight.shape[0], (context + max(sizes),), generator=g).to(dec.device)
        cache = DynamicCache()
        dec.forward(ids[:context], cache)
        times = {n: [] for n in sizes}
        for r in range(warmup + rounds):
            order = sizes[r % len(sizes):] + sizes[: r % len(sizes)]
            for n in order:
                t0 = time.perf_counter()
                out = dec.forward(ids[context: context + n], cache)
                dec.mm.mm(out, dec.weight).argmax(-1)
                dt = time.perf_counter() - t0
                crop_to(cache, context)
                if r >= warmup:
                    times[n].append(dt)
        one = statistics.median(times[1])
        return {"costs": {n: statistics.median(t) / one for n, t in times.items()},
                "spread": {n: [min(t) / one, max(t) / one] for n, t in times.items()},
                "one_token_ms": one * 1e3, "context": context, "rounds": rounds}


def draft_cost(dec, plan, prompt: list[int], reps: int = 5) -> float:
    """Median wall time of drafting `plan` after `prompt` (seconds), warm."""
    if dec.drafter is None or (isinstance(plan, TreeShape) and plan.n == 0):
        return 0.0
    with dec.routing(), torch.inference_mode():
        from transformers import DynamicCache

        ids = torch.as_tensor(prompt, dtype=torch.long, device=dec.device)
        hidden, aux = dec.forward_aux(ids, DynamicCache())
        tokens = torch.cat([ids, ids[-1:]])
        times = []
        for r in range(reps + 1):
            dec.drafter.reset()
            # fill the drafter's caches first: a step then drafts warm
            draft_tree(dec.drafter, tokens[:-1], hidden[:-1], TreeShape.chain(dec.k), dec.k,
                       None if aux is None else aux[:-1])
            t0 = time.perf_counter()
            draft_tree(dec.drafter, tokens, hidden, plan, dec.k, aux)
            if r:
                times.append(time.perf_counter() - t0)
        dec.drafter.reset()
        return statistics.median(times)
