"""Drafting a token tree level by level: a static shape (Medusa-style) or a dynamic tree (EAGLE-2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mtp_train.trees import DraftTree, TreeShape


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2-style: at each level expand the `width` best frontier nodes (cumulative draft
    log-probability) into their `topk` candidates each, then keep the best `nodes` overall."""

    nodes: int = 16
    topk: int = 4
    width: int = 4
    depth: int | None = None  # None = every head

    def label(self) -> str:
        return f"dynamic{self.nodes}"



def draft_tree(drafter, tokens: torch.Tensor, hidden: torch.Tensor, plan, max_depth: int,
               aux: torch.Tensor | None = None) -> DraftTree:
    """Draft the nodes `plan` asks for (a TreeShape or a DynamicTree), level by level, no deeper than
    `max_depth`; `aux` (N - 1, n * d): the backbone's auxiliary states, for heads that read them."""
    tree = DraftTree()
    if isinstance(plan, TreeShape):
        depth = min(plan.depth, max_depth)
    else:
        depth = min(plan.depth or drafter.k, drafter.k, max_depth)
    if depth <= 0 or (isinstance(plan, TreeShape) and plan.n == 0):
        return tree
    drafter.begin(tokens, hidden, aux)
    if isinstance(plan, TreeShape):
        node_of: dict[tuple, int] = {(): -1}
        by_depth: dict[int, list[tuple]] = {}
        for path in plan.paths:
            if len(path) <= depth:
                by_depth.setdefault(len(path), []).append(path)
        for j in range(1, depth + 1):
            paths = by_depth.get(j, [])
            parents = sorted({node_of[pth[:-1]] for pth in paths})
            if not paths:
                break
            lp = drafter.level(j, parents, tree)  # (len(parents), |D|)
            width = max(pth[-1] for pth in paths) + 1
            top_lp, top_idx = lp.topk(min(width, lp.shape[-1]), -1)
            tok = drafter.to_tokens(top_idx).tolist()
            row = {u: i for i, u in enumerate(parents)}
            top_lp = top_lp.tolist()
            for pth in paths:
                u, r = node_of[pth[:-1]], pth[-1]
                if r >= len(tok[row[u]]):
                    continue
                base = 0.0 if u < 0 else tree.scores[u]
                node_of[pth] = tree.add(tok[row[u]][r], u, base + top_lp[row[u]][r], math.exp(top_lp[row[u]][r]),
                                        ranks=pth)
        return tree
    frontier = [-1]
    for j in range(1, depth + 1):
        lp = drafter.level(j, frontier, tree)
        top_lp, top_idx = lp.topk(min(plan.topk, lp.shape[-1]), -1)
        tok, top_lp = drafter.to_tokens(top_idx).tolist(), top_lp.tolist()
        new = []
        for i, u in enumerate(frontier):
            base = 0.0 if u < 0 else tree.scores[u]
            for r in range(len(tok[i])):
                new.append(tree.add(tok[i][r], u, base + top_lp[i][r], math.exp(top_lp[i][r])))
        frontier = sorted(new, key=lambda v: -tree.scores[v])[: plan.width]
    if tree.n > plan.nodes:  # scores only fall along a path, so the best n are parent-closed
        best = sorted(range(tree.n), key=lambda v: (-tree.scores[v], tree.depths[v]))[: plan.nodes]
        keep = set(best)
        for v in best:
            keep.update(tree.path_to(v))
        tree = tree.keep(sorted(keep))
    return tree

