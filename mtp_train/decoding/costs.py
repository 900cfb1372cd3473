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

# This machine's speed drifts over seconds, not per call (the memory traffic of whatever shares the
# host): on the AVX2 EPYC (family 25 model 1) one-token forwards read 52-71 ms as means of ten in a
# row, lag-one autocorrelation 0.64, gone after about 20 forwards (docs/decoding.md, "Timing on a
# noisy machine"). So what is compared is timed side by side, and the figure kept is the median of
# the per-round ratios, not a ratio of medians taken seconds apart.


def _rotated(items: list, r: int) -> list:
    """`items` starting at its (r mod len)-th: the order of round r, so no item always goes first."""
    r %= len(items)
    return items[r:] + items[:r]


def paired_ratios(items: list, time_item, time_unit, rounds: int, warmup: int = 1) -> tuple[dict, list[float]]:
    """Each of `items` timed between two reference calls (`time_unit()`, e.g. a one-token forward;
    both return seconds) and read as its time over their mean, in `warmup` untimed rounds and then
    `rounds` rounds whose order of items rotates. Returns ({item: [ratio per round]}, [every
    reference time of the timed rounds, each once])."""
    ratios = {x: [] for x in items}
    units: list[float] = []
    for r in range(warmup + rounds):
        before = time_unit()
        for x in _rotated(items, r) if items else []:
            t, after = time_item(x), time_unit()
            if r >= warmup:
                ratios[x].append(t / (0.5 * (before + after)))
                units.append(before)
            before = after
        if r >= warmup:
            units.append(before)
    return ratios, units


def measure_matmuls(dec, reps: int = 6, context: int = 128, buckets=ROW_BUCKETS) -> MatmulPlan:
    """For each row-count bucket, time a whole backbone forward of that many tokens (LM head
    included) with every linear in each layout of matmul.LAYOUTS (`F.linear`, `W @ x^T`, and
    oneDNN's packed weights where this CPU can pack them), the layouts back to back in a rotating
    order, and route that bucket through the layout with the lowest median ratio to F.linear's time
    in the same round (`reps` rounds for up to 16 rows, half as many above but at least 2: the
    decoder's steps are mostly small; one warm-up round first). Heads and draft projections follow the same choice; the
    packed copies are kept only where chosen."""
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
            ratios = {t: [] for t in layouts}
            for r in range(1 + (reps if rows <= 16 else max(2, reps // 2))):
                times = {}
                for t in _rotated(layouts, r):
                    with routed_linears(plans[t], *mods):
                        t0 = time.perf_counter()
                        out = dec.forward(ids[context: context + rows], cache)
                        plans[t].mm(out, dec.weight).argmax(-1)
                        times[t] = time.perf_counter() - t0
                    crop_to(cache, context)
                if r:
                    for t in layouts:
                        ratios[t].append(times[t] / times["L"])
            chosen[i] = min(layouts, key=lambda t: statistics.median(ratios[t]))
    dec.mm.choices.update({key: list(chosen) for key in keys})
    if "P" in chosen:  # keep the packed copies made while timing (each weight is packed once)
        dec.mm.adopt_packed(plans["P"])
    return dec.mm


def verify_costs(dec, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), context: int = 128,
                 rounds: int = 7, warmup: int = 1, clock=time.perf_counter) -> dict:
    """Wall time of one backbone forward over n new tokens (plus the LM head and argmax) after
    `context` cached tokens, relative to one token. Each n is timed between two one-token forwards
    and read as its time over their mean; `costs[n]` is the median of those ratios over `rounds`
    rounds (the order of sizes rotates; `warmup` untimed rounds first), made non-decreasing in n
    (`monotone`: a forward over more tokens does no less work, so a dip is noise). Returns
    {"costs": {n: ratio}, "raw": {n: the medians before the fit}, "spread": {n: [min, max] ratio},
    "one_token_ms": the median one-token time, "context", "rounds"}."""
    with dec.routing(), torch.inference_mode():
        from transformers import DynamicCache

        sizes = sorted(set(sizes) | {1})
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, dec.weight.shape[0], (context + max(sizes),), generator=g).to(dec.device)
        cache = DynamicCache()
        dec.forward(ids[:context], cache)

        def timed(n: int) -> float:
            t0 = clock()
            out = dec.forward(ids[context: context + n], cache)
            dec.mm.mm(out, dec.weight).argmax(-1)
            dt = clock() - t0
            crop_to(cache, context)
            return dt

        ratios, ones = paired_ratios(sizes[1:], timed, lambda: timed(1), rounds, warmup)
        one = statistics.median(ones)
        ratios[1] = [t / one for t in ones]
        raw = {n: statistics.median(v) for n, v in ratios.items()}
        raw[1] = 1.0
        fit = monotone([raw[n] for n in sizes])
        return {"costs": {n: c / fit[0] for n, c in zip(sizes, fit, strict=True)}, "raw": raw,
                "spread": {n: [min(v), max(v)] for n, v in ratios.items()},
                "one_token_ms": one * 1e3, "context": context, "rounds": rounds}


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in squared error (pool adjacent violators:
    a run that falls is replaced by its mean, repeatedly)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


def draft_costs(dec, plans: list, prompt: list[int], rounds: int = 5, clock=time.perf_counter) -> dict:
    """Drafting each of `plans` after `prompt` (warm: the drafter's caches filled first, untimed),
    in one-token forwards: each draft is timed between two one-token backbone forwards (with the LM
    head and argmax, as `verify_costs` times them, but after the prompt rather than a 128-token
    cache: the drafts read the prompt's hidden states) and read as its time over their mean; the median over `rounds` rounds (one warm-up round first, the plans'
    order rotating), so a slow phase of the machine slows both sides of the ratio. Returns
    {"costs": [per plan, in one-token forwards], "one_token_ms": the median reference}; an empty
    plan, or a decoder without a drafter, costs 0."""
    costs = [0.0] * len(plans)
    todo = [i for i, p in enumerate(plans) if dec.drafter is not None and not (isinstance(p, TreeShape) and p.n == 0)]
    if not todo:
        return {"costs": costs, "one_token_ms": None}
    with dec.routing(), torch.inference_mode():
        from transformers import DynamicCache

        ids = torch.as_tensor(prompt, dtype=torch.long, device=dec.device)
        cache = DynamicCache()
        hidden, aux = dec.forward_aux(ids, cache)
        tokens = torch.cat([ids, ids[-1:]])

        def one_token() -> float:
            t0 = clock()
            out = dec.forward(ids[-1:], cache)
            dec.mm.mm(out, dec.weight).argmax(-1)
            dt = clock() - t0
            crop_to(cache, len(ids))
            return dt

        def drafting(i: int) -> float:
            dec.drafter.reset()
            draft_tree(dec.drafter, tokens[:-1], hidden[:-1], TreeShape.chain(dec.k), dec.k,
                       None if aux is None else aux[:-1])
            t0 = clock()
            draft_tree(dec.drafter, tokens, hidden, plans[i], dec.k, aux)
            return clock() - t0

        ratios, ones = paired_ratios(todo, drafting, one_token, rounds)
        dec.drafter.reset()
    for i in todo:
        costs[i] = statistics.median(ratios[i])
    return {"costs": costs, "one_token_ms": statistics.median(ones) * 1e3}
