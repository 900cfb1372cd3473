"""Depth policies for the adaptive mode: which tree to verify at each step."""

from __future__ import annotations

from mtp_train.trees import TreeShape


class AcceptanceModel:
    """Running estimate of how many drafts a static tree gets accepted: per rank path P, the chance
    that P's draft is the backbone's token given its parent was, from prior rank statistics (worth
    `prior_weight` steps; Beta(1, 1) without statistics) updated by every verified step."""

    def __init__(self, prefix=None, total: int = 0, prior_weight: float = 8.0):
        self.prefix, self.total, self.w = prefix or {}, total, prior_weight
        self.succ: dict[tuple, float] = {}
        self.trials: dict[tuple, float] = {}

    def q(self, path: tuple) -> float:
        if self.total:
            parent = self.prefix.get(path[:-1], 0) if len(path) > 1 else self.total
            s0 = self.w * self.prefix.get(path, 0) / self.total
            t0 = self.w * parent / self.total
        else:
            s0, t0 = 1.0, 2.0
        return (s0 + self.succ.get(path, 0.0)) / max(1e-9, t0 + self.trials.get(path, 0.0))

    def expected(self, shape: TreeShape) -> float:
        out, chance = 0.0, {(): 1.0}
        for path in shape.paths:
            chance[path] = chance.get(path[:-1], 0.0) * self.q(path)
            out += chance[path]
        return out

    def update(self, shape: TreeShape, accepted_ranks: tuple) -> None:
        for path in shape.paths:
            m = len(path)
            if path[:-1] == accepted_ranks[: m - 1] and len(accepted_ranks) >= m - 1:
                self.trials[path] = self.trials.get(path, 0.0) + 1
                self.succ[path] = self.succ.get(path, 0.0) + float(accepted_ranks[:m] == path)


class CostPolicy:
    """Pick, each step, the candidate tree maximising E[committed tokens] / cost: E = 1 + the
    running expected accepted drafts (`AcceptanceModel`), cost = the measured time of verifying
    n + 1 tokens plus drafting the tree, relative to a plain one-token step. When "no drafts" wins,
    the smallest tree is still tried every `probe` steps, so the estimates can recover."""

    def __init__(self, trees: list[TreeShape], costs: list[float], model: AcceptanceModel | None = None,
                 probe: int = 16):
        self.trees, self.costs, self.model, self.probe = trees, costs, model or AcceptanceModel(), probe
        self._idle = 0

    @classmethod
    def chains(cls, k: int, cost: list[float]) -> CostPolicy:
        """Chains of 0..k drafts with `cost[n]` for n drafts."""
        return cls([TreeShape.chain(n) for n in range(k + 1)], list(cost))

    def choose(self, **_) -> TreeShape:
        rates = [(1 + self.model.expected(t)) / c for t, c in zip(self.trees, self.costs, strict=True)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if self.trees[best].n == 0:
            self._idle += 1
            if self._idle >= self.probe:
                self._idle = 0
                return min((t for t in self.trees if t.n), key=lambda t: t.n, default=self.trees[best])
        return self.trees[best]

    def update(self, shape: TreeShape, accepted_ranks: tuple, **_) -> None:
        if shape.n:
            self.model.update(shape, accepted_ranks)


class EntropyPolicy:
    """EntMTP: one tree per entropy bucket of the backbone (deeper where it is confident), chosen by
    the entropy of the distribution that made the last committed token. `edges` are the bucket
    boundaries in nats; `trees[b]` is verified in bucket b."""

    def __init__(self, trees: list[TreeShape], edges=(0.5, 1.5, 3.0)):
        if len(trees) != len(edges) + 1:
            raise ValueError(f"EntropyPolicy: {len(edges)} edges need {len(edges) + 1} trees, got {len(trees)}")
        self.trees, self.edges, self.h = trees, tuple(edges), 0.0

    @classmethod
    def chains(cls, k: int, low: float = 0.5, high: float = 3.0) -> EntropyPolicy:
        """Without rank statistics: all k heads at or below `low` nats, none at or above `high`."""
        mid = (low + high) / 2
        return cls([TreeShape.chain(k), TreeShape.chain(max(1, k // 2 + k % 2)),
                    TreeShape.chain(1), TreeShape.chain(0)], (low, mid, high))

    def choose(self, entropy: float | None = None, **_) -> TreeShape:
        h = self.h if entropy is None else entropy
        return self.trees[sum(h >= e for e in self.edges)]

    def update(self, shape: TreeShape, accepted_ranks: tuple, entropy: float = 0.0, **_) -> None:
        self.h = entropy

