"""Where a step's drafts come from: the plan of what to draft, asked for once per step.

A plan source has `drafts` (False for the backbone alone), `plan(k, state)` -> a TreeShape (a chain
is one) or a DynamicTree, `cut(tree, state)` -> the drafted tree, possibly cut back, before
verification, and `update(plan, accepted_ranks, entropy)` after it. `state` is the decoder's: the
committed tokens, the backbone's states (`hidden`, (N - 1, d)) and the `entropy` of the distribution
that made the last committed token.

    NoDrafts   the backbone alone (greedy decoding, the reference)
    Chain      a chain of n drafts (all k heads by default)
    Tree       a static TreeShape (Medusa-style) or a DynamicTree (EAGLE-2-style)
    Span       a span-length policy picks m: before drafting when it reads only the backbone's state
               (then only m heads run), else after it from the heads' top-1 probabilities
    Adaptive   a depth policy (policies.CostPolicy, EntropyPolicy) picks the tree per step and
               learns from each verified step
    Sampled    any of these with its static shapes' drafts drawn from the heads' warped
               distribution (sampling.DraftSampler) instead of taken as their top candidates
"""

from __future__ import annotations

import torch

from mtp_train.trees import DraftTree, TreeShape


class PlanSource:
    """What every plan source has; `plan` is each one's own."""

    drafts = True
    sampler = None  # a sampling.DraftSampler: drafts are drawn, not the top candidates

    def plan(self, k: int, state):
        raise NotImplementedError

    def cut(self, tree: DraftTree, state) -> DraftTree:
        return tree

    def update(self, plan, accepted_ranks: tuple, entropy: float) -> None:
        pass


class NoDrafts(PlanSource):
    drafts = False

    def plan(self, k: int, state) -> TreeShape:
        return TreeShape(())


class Chain(PlanSource):
    def __init__(self, n: int | None = None):
        self.n = n

    def plan(self, k: int, state) -> TreeShape:
        return TreeShape.chain(k if self.n is None else min(self.n, k))


class Tree(PlanSource):
    def __init__(self, tree):
        self.tree = tree  # a TreeShape or a DynamicTree

    def plan(self, k: int, state):
        return self.tree


class Span(PlanSource):
    """`policy(hidden (d,), head_probs (k,) or None)` -> m in 0..k; with `needs_probs = False` it is
    asked before drafting, with head_probs None."""

    def __init__(self, policy):
        self.policy = policy
        self.before = getattr(policy, "needs_probs", True) is False

    def plan(self, k: int, state) -> TreeShape:
        return TreeShape.chain(int(self.policy(state.hidden[-1], None)) if self.before else k)

    def cut(self, tree: DraftTree, state) -> DraftTree:
        if self.before or not tree.n:
            return tree
        m = int(self.policy(state.hidden[-1], torch.tensor(tree.probs)))
        cut = tree.keep(list(range(min(tree.n, m))))
        # the cut read the drafts: the kept ones are no longer plain draws from q, so speculative
        # sampling verifies them as chosen outright (lossless for any choice of drafts)
        cut.proposals = {}
        return cut


class Adaptive(PlanSource):
    def __init__(self, policy):
        self.policy = policy  # anything with choose(entropy=) and update(shape, ranks, entropy=)

    def plan(self, k: int, state):
        return self.policy.choose(entropy=state.entropy)

    def update(self, plan, accepted_ranks: tuple, entropy: float) -> None:
        self.policy.update(plan, accepted_ranks, entropy=entropy)


class Sampled(PlanSource):
    """`source` with its drafts drawn by `sampler` (the plan, cut and update are the source's)."""

    def __init__(self, source: PlanSource, sampler):
        self.source, self.sampler, self.drafts = source, sampler, source.drafts

    def plan(self, k: int, state):
        return self.source.plan(k, state)

    def cut(self, tree: DraftTree, state) -> DraftTree:
        return self.source.cut(tree, state)

    def update(self, plan, accepted_ranks: tuple, entropy: float) -> None:
        self.source.update(plan, accepted_ranks, entropy)
