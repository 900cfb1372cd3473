"""Acceptance rules: which drafted nodes a verified step keeps, given the backbone's logits over
[x, nodes]. A rule is an object passed to `Decoder.generate`; it returns the kept path's node
indices, root first, and picks the token the backbone commits after it.

    ExactMatch   follow, from x, the child whose token is the backbone's greedy choice (lossless)
    Relaxed      keep chain draft d_i while p(d_i) >= delta * max p and the summed log-prob drift
                 sum_i (log max p - log p(d_i)) stays <= budget ("Match the Distribution"; budget 0
                 is ExactMatch)
    Unverified   keep every drafted node of a chain (CLP's lossy span: commit without checking)
    RejectionSampling
                 speculative sampling at a temperature > 0 (sampling.verify_tree): lossless in
                 distribution; it picks the token after the path itself (a residual or bonus
                 draw), returned as the path's `token`
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mtp_train.decoding.sampling import Draws, verify_tree
from mtp_train.trees import DraftTree, greedy_accept


class Kept(list):
    """A kept path (node indices, root first) whose rule also chose the token committed after it."""

    def __init__(self, path, token: int):
        super().__init__(path)
        self.token = token


class AcceptRule:
    """What every rule has: `accept` (below, per rule) and the token committed after the path."""

    def accept(self, d: DraftTree, logits: torch.Tensor) -> list[int]:
        raise NotImplementedError

    def next_token(self, logits: torch.Tensor) -> int:
        """The token the backbone commits after the kept path, from its logits there (V,): its
        greedy choice."""
        return int(logits.argmax())


class ExactMatch(AcceptRule):
    """Lossless greedy verification over a chain or a tree."""

    def accept(self, d: DraftTree, logits: torch.Tensor) -> list[int]:
        return greedy_accept(d, logits.argmax(-1).tolist())


@dataclass(frozen=True)
class Relaxed(AcceptRule):
    delta: float = 0.5
    budget: float = 0.0

    def accept(self, d: DraftTree, logits: torch.Tensor) -> list[int]:
        if not d.is_chain():
            raise ValueError("relaxed acceptance keeps a prefix of a chain; it was given a tree")
        drafts = torch.tensor(d.tokens, dtype=torch.long, device=logits.device)
        return list(range(relaxed_prefix(logits[: d.n], drafts, self.delta, self.budget)))


class Unverified(AcceptRule):
    def accept(self, d: DraftTree, logits: torch.Tensor) -> list[int]:
        return list(range(d.n))


class RejectionSampling(AcceptRule):
    """Lossless speculative sampling: the backbone's distribution warped by `warpers`
    (sampling.Warpers), the drafts verified by recursive rejection sampling over the tree, every
    draw from `generator`. `leniency` < 1: the lossy relaxation (`verify_tree`)."""

    def __init__(self, warpers, generator: torch.Generator | None = None, leniency: float = 1.0):
        self.warpers, self.draws, self.leniency = warpers, Draws(generator), leniency

    def accept(self, d: DraftTree, logits: torch.Tensor) -> Kept:
        path, token = verify_tree(lambda row: self.warpers.probs(logits[row]), d, self.draws, self.leniency)
        return Kept(path, token)

    def next_token(self, logits: torch.Tensor) -> int:
        return self.draws.draw(self.warpers.probs(logits))


def relaxed_prefix(logits: torch.Tensor, drafts: torch.Tensor, delta: float, budget: float) -> int:
    """How many chain drafts relaxed acceptance keeps: logits (n, V) at x and each draft's parent,
    drafts (n,)."""
    logp = torch.log_softmax(logits.float(), -1)  # (n, V)
    top = logp.max(-1).values  # (n,)
    mine = logp.gather(-1, drafts[:, None])[:, 0]  # (n,)
    drift, kept = 0.0, 0
    for i in range(len(drafts)):
        gap = float(top[i] - mine[i])
        if gap > -math.log(delta) + 1e-12 or drift + gap > budget + 1e-12:
            break
        drift += gap
        kept += 1
    return kept
