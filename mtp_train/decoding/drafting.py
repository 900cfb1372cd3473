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
               aux: torch.Tensor | None = None, sampler=None) -> DraftTree:
    """Draft the nodes `plan` asks for (a TreeShape or a DynamicTree), level by level, no deeper than
    `max_depth`; `aux` (N - 1, n * d): the backbone's auxiliary states, for heads that read them.

    `sampler` (sampling.DraftSampler): a static shape's children are drawn from the heads' warped
    distribution (rank r = the r-th draw) and the distribution is kept in `tree.proposals`; without
    one they are the heads' top-r. Dynamic trees always take the top candidates: their pruning picks
    nodes by score, so drawn children would no longer be draws (speculative sampling verifies them
    as chosen outright)."""
    tree = DraftTree()
    if isinstance(plan, TreeShape):
        depth = min(plan.depth, max_depth)
    else:
        depth = min(plan.depth or drafter.k, drafter.k, max_depth)
    if depth <= 0 or (isinstance(plan, TreeShape) and plan.n == 0):
        return tree
    drafter.begin(tokens, hidden, aux)
    vocab = getattr(sampler, "vocab", None)
    if isinstance(plan, TreeShape):
        node_of: dict[tuple, int] = {(): -1}
        by_depth: dict[int, list[tuple]] = {}
        for path in plan.paths:
            if len(path) <= depth:
                by_depth.setdefault(len(path), []).append(path)
        for j in range(1, depth + 1):
            paths = [pth for pth in by_depth.get(j, []) if pth[:-1] in node_of]  # parents drafted
            if not paths:
                break
            parents = sorted({node_of[pth[:-1]] for pth in paths})
            lp = drafter.level(j, parents, tree)  # (len(parents), |D|)
            # a path's candidate: its rank among the heads' top candidates, or, when drawing, its
            # place among its siblings (so that the kept children are always the first draws)
            slot = {pth: pth[-1] for pth in paths}
            if sampler is not None:
                for u_path in {pth[:-1] for pth in paths}:
                    sibs = sorted(pth for pth in paths if pth[:-1] == u_path)
                    slot.update({pth: i for i, pth in enumerate(sibs)})
            width = max(slot.values()) + 1
            if sampler is None:
                top_lp, top_idx = lp.topk(min(width, lp.shape[-1]), -1)
            else:
                top_lp, top_idx, q = sampler.pick(lp, width)
                q = _on_vocabulary(drafter, q, vocab)  # all parents' rows at once
                for u, dist in zip(parents, q, strict=True):
                    tree.proposals[u] = dist
            tok = drafter.to_tokens(top_idx).tolist()
            row = {u: i for i, u in enumerate(parents)}
            top_lp = top_lp.tolist()
            for pth in paths:
                u, r = node_of[pth[:-1]], slot[pth]
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



def _on_vocabulary(drafter, q: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """Distributions over the draft vocabulary (rows, |D|) as ones over the backbone's (rows, V)
    (zero outside)."""
    if vocab is None or vocab == q.shape[-1]:  # no draft vocabulary: the identity map
        return q
    ids = drafter.to_tokens(torch.arange(q.shape[-1], device=q.device))
    return q.new_zeros(q.shape[0], vocab).index_copy_(1, ids, q)
