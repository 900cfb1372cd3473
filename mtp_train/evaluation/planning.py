"""Which trees mode tree, dynamic and adaptive verify: grown from the heads' rank statistics
(mtp_train/trees.py) and sized by this machine's measured verify and drafting costs
(docs/decoding.md, "Trees").
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def plan_trees(dec, stats, prompt: list[int], cfg, rounds: int = 7, draft_rounds: int = 5) -> dict:
    """Measure this machine's verify cost curve and drafting costs, and pick: the static tree with
    the most expected committed tokens per unit of step time (`tree`), a dynamic tree of the same
    node count (`dynamic`), the cost/acceptance Pareto front (adaptive, cost policy) and one tree per
    entropy bucket (adaptive, entropy policy: EntMTP). Without rank statistics the chain stands in
    for the static tree and the entropy policy uses chains. `rounds`: the cost curve's timing rounds; `draft_rounds`: the drafting costs'."""
    from mtp_train.decoding import DynamicTree
    from mtp_train.decoding.costs import draft_costs, verify_costs
    from mtp_train.trees import TreeShape, expected_accepted, grow_tree, pareto_front

    k = dec.k
    shapes = {TreeShape.chain(k).paths: TreeShape.chain(k)}
    prefix, total = (stats.prefix_counts(), stats.total()) if stats is not None and stats.total() else ({}, 0)
    budgets = [cfg.tree_nodes] if cfg.tree_nodes else list(cfg.tree_budgets)
    for b in budgets if total else []:
        shape = grow_tree(prefix, b, k)
        if shape.n:
            shapes.setdefault(shape.paths, shape)
    sizes = sorted({1, 2, 4, 8, 16, 32, 64} | set(range(1, k + 2)) | {s.n + 1 for s in shapes.values()})
    curve = verify_costs(dec, sizes=tuple(sizes), rounds=rounds)
    # drafting, in one-token forwards timed beside it (decoding/costs.py: draft_costs); the drafts'
    # dtype is the cheaper of the decoder's and bf16 (drafts need not be exact)
    draft_dtypes = {}
    for dtype in dict.fromkeys((dec.draft_dtype, torch.bfloat16)):
        dec.set_draft_dtype(dtype)
        got = draft_costs(dec, [TreeShape.chain(k)], prompt, rounds=draft_rounds)
        draft_dtypes[dtype] = (got["costs"][0], got["one_token_ms"])
    dec.set_draft_dtype(min(draft_dtypes, key=lambda d: draft_dtypes[d][0]))
    log.info("drafting a chain of %d, in one-token forwards: %s; drafting in %s", k, ", ".join(
        f"{str(d).replace('torch.', '')} {c:.3f}" for d, (c, _) in draft_dtypes.items()), dec.draft_dtype)
    drafts = draft_costs(dec, list(shapes.values()), prompt, rounds=draft_rounds)["costs"]
    rows = []
    for shape, draft in zip(shapes.values(), drafts, strict=True):
        tau = 1 + expected_accepted(shape, prefix, total) if total else None
        cost = curve["costs"][shape.n + 1] + draft
        rows.append({"shape": shape, "label": shape.label(), "nodes": shape.n, "depth": shape.depth,
                     "predicted_tau": tau, "verify_cost": curve["costs"][shape.n + 1],
                     "draft_cost": draft, "cost": cost,
                     "rate": None if tau is None else tau / cost})
    scored = [r for r in rows if r["rate"] is not None]
    static = max(scored, key=lambda r: r["rate"])["shape"] if scored else TreeShape.chain(k)
    if cfg.tree_nodes and scored:  # a size the user asked for
        static = next((r["shape"] for r in scored if not r["shape"].is_chain), static)
    dynamic = DynamicTree(nodes=static.n, topk=cfg.dynamic_topk, width=cfg.dynamic_topk)
    empty = {"shape": TreeShape(()), "predicted_tau": 1.0, "cost": 1.0}
    cands = [empty, *scored] if scored else [empty, *({**r, "predicted_tau": 1.0 + 0.5 * r["nodes"]}
                                                      for r in rows)]
    front = pareto_front(cands)
    by_entropy = None
    if total:
        by_entropy = []
        for bucket in range(len(stats.counts)):
            pb, tb = stats.prefix_counts(bucket), stats.total(bucket)
            if tb < 30:  # too few positions to grow a tree of its own
                by_entropy.append(static)
                continue
            best, best_rate = TreeShape(()), 1.0
            for r in rows:
                shape = r["shape"] if r["shape"].is_chain else grow_tree(pb, r["nodes"], k)
                if shape.n + 1 not in curve["costs"]:
                    continue
                rate = (1 + expected_accepted(shape, pb, tb)) / (curve["costs"][shape.n + 1] + r["draft_cost"])
                if rate > best_rate:
                    best, best_rate = shape, rate
            by_entropy.append(best)
    summary = {
        "static": static.label(), "static_paths": [list(p) for p in static.paths], "dynamic": dynamic.label(),
        "candidates": [{kk: v for kk, v in r.items() if kk != "shape"} for r in rows],
        "pareto": [c["shape"].label() if c["shape"].n else "none" for c in front],
        "entropy_trees": [t.label() if t.n else "none" for t in by_entropy] if by_entropy else None,
        "entropy_edges": list(stats.edges) if total else None, "rank_positions": total,
        "draft_dtype": str(dec.draft_dtype).replace("torch.", ""), "draft_rounds": draft_rounds,
        "draft_cost_by_dtype": {str(d).replace("torch.", ""): c for d, (c, _) in draft_dtypes.items()},
        "draft_ms_by_dtype": {str(d).replace("torch.", ""): c * ms for d, (c, ms) in draft_dtypes.items()}}
    log.info("verify cost on this machine (n tokens / 1 token, one token %.1f ms): %s", curve["one_token_ms"],
             ", ".join(f"{n}: {c:.2f}" for n, c in curve["costs"].items()))
    for r in rows:
        log.info("  %-8s predicted tau %s, verify %.2f + draft %.2f = cost %.2f%s", r["label"],
                 "-" if r["predicted_tau"] is None else f"{r['predicted_tau']:.2f}", r["verify_cost"],
                 r["draft_cost"], r["cost"], "" if r["rate"] is None else f", tau/cost {r['rate']:.2f}")
    log.info("tree mode verifies %s; dynamic %s", static.label(), dynamic.label())
    return {"tree": static, "dynamic": dynamic, "curve": curve, "pareto": front, "by_entropy": by_entropy,
            "stats": stats if total else None, "summary": summary}


def adaptive_policy(plan: dict, cfg):
    """A fresh policy for one decode: the cost policy over the Pareto trees (running acceptance
    seeded by the rank statistics), or the entropy policy over the per-bucket trees."""
    from mtp_train.decoding import AcceptanceModel, CostPolicy, EntropyPolicy

    stats = plan["stats"]
    if cfg.adaptive_policy == "cost":
        model = AcceptanceModel(stats.prefix_counts(), stats.total()) if stats else AcceptanceModel()
        front = plan["pareto"]
        return CostPolicy([c["shape"] for c in front], [c["cost"] for c in front], model)
    if plan["by_entropy"]:
        return EntropyPolicy(plan["by_entropy"], stats.edges)
    return EntropyPolicy.chains(plan["tree"].depth or 1, cfg.entropy_low, cfg.entropy_high)
