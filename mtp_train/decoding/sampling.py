"""Speculative sampling's pieces, as pure tensor functions (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling").

    Warpers          temperature, top-k, top-p and min-p as HF's GenerationConfig applies them
                     (in that order, the same ties kept), to the backbone's p and the drafts' q alike
    accept_chance    a draft x sampled from q is kept with probability min(1, p(x) / q(x))
    residual         on a rejection the token comes from max(0, p - q), normalised
    verify_chain     one chain step: keep drafts while they pass, then a token from the residual,
                     or, after a fully kept chain, a bonus token from p (the plain reference)
    DraftSampler     draws a node's children from the heads' warped q, without replacement, and
                     keeps q on the tree (`DraftTree.proposals`) for the verifier
    verify_tree      one step over a token tree: recursive rejection sampling over each node's
                     children, in their order (a chain is the one-child case)

Why it is lossless: the token emitted at a depth is x with probability q(x) min(1, p(x)/q(x)) +
(1 - sum_y min(p(y), q(y))) * residual(x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x), and a kept
draft leaves the next depth in the same situation one token on. Over several children the rejected
child's residual becomes the target for the next child, each child tested against the distribution
it was really drawn from: q with the earlier siblings removed (drawn without replacement), or a
point mass for children chosen without sampling (top-k or pruned trees, where q(c) = 1 and the test
is "keep c with probability p(c)"). Each test is a valid rejection sampler for its target whatever
happened before it, so the token the node emits has the backbone's distribution (docs/decoding.md,
"Speculative sampling"; tests/test_sampling.py enumerates every outcome).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Warpers:
    """The sampling distribution's shape; the defaults change nothing (pure temperature-1 sampling)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1: no top-p
    min_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0 (0 is greedy decoding, not sampling), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1] or null, got {self.min_p}")

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> warped logits (float32), -inf where a warper removed the token."""
        x = logits.float()
        if self.temperature != 1.0:
            x = x / self.temperature
        if self.top_k:
            kth = x.topk(min(self.top_k, x.shape[-1]), -1).values[..., -1:]
            x = x.masked_fill(x < kth, -torch.inf)  # ties with the k-th value stay
        if self.top_p < 1.0:
            ascending, order = x.sort(-1)
            mass_below = ascending.softmax(-1).cumsum(-1)
            drop = mass_below <= 1 - self.top_p  # the least likely tokens holding at most 1 - top_p
            drop[..., -1] = False  # the most likely token always stays
            x = x.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
        if self.min_p is not None:
            p = x.softmax(-1)
            drop = p < self.min_p * p.amax(-1, keepdim=True)
            drop.scatter_(-1, p.argmax(-1, keepdim=True), False)
            x = x.masked_fill(drop, -torch.inf)
        return x

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> the warped distribution (..., V), float32."""
        return self.logits(logits).softmax(-1)


def accept_chance(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for a draft x drawn from q (q(x) > 0 since x was drawn)."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V): max(0, p - q), normalised; p itself where q covers p everywhere (then a rejection
    has probability 0, and any distribution is correct)."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def verify_chain(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """One speculative-sampling step over a chain of n drafts.

    p (n + 1, V): the backbone's warped distributions at x and after each draft; q (n, V): the
    distributions each draft was sampled from (warped alike); drafts (n,). Returns (kept, token):
    how many leading drafts are kept and the token committed after them (from the residual at the
    first rejection, from p[n] after a fully kept chain)."""
    n = len(drafts)
    for i in range(n):
        d = int(drafts[i])
        u = torch.rand((), generator=generator, device=p.device)
        if u < accept_chance(p[i, d], q[i, d]):
            continue
        return i, int(torch.multinomial(residual(p[i], q[i]), 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))


class DraftSampler:
    """Draws drafts from the heads' warped distribution instead of taking their top-k.

    `pick(logp (rows, |D|), width)` -> (log-probs (rows, w), draft indices (rows, w), q (rows, |D|)):
    each row's `width` children drawn without replacement from q = warpers(logp) (fewer where q has
    fewer tokens), in draw order. The generator is the decode's, so a seeded run repeats."""

    def __init__(self, warpers: Warpers, generator: torch.Generator | None = None, vocab: int | None = None):
        self.warpers, self.generator = warpers, generator
        self.vocab = vocab  # the backbone's vocabulary size, for proposals over a draft vocabulary

    def pick(self, logp: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.warpers.probs(logp)
        w = max(1, min(width, int((q > 0).sum(-1).min())))
        idx = torch.multinomial(q, w, replacement=False, generator=self.generator)
        return logp.gather(-1, idx), idx, q


def _without(dist: torch.Tensor, token: int) -> torch.Tensor | None:
    """`dist` with `token` removed, renormalised; None when nothing is left."""
    out = dist.clone()
    out[token] = 0.0
    total = out.sum()
    return out / total if total > 0 else None


class Draws:
    """The randomness of verification: `coin(chance)` is True with probability `chance`, `draw(dist)`
    a token from `dist` (V,). From a seeded generator here; tests replace it to enumerate every
    outcome exactly."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def coin(self, chance: torch.Tensor) -> bool:
        return bool(torch.rand((), generator=self.generator, device=chance.device) < chance)

    def draw(self, dist: torch.Tensor) -> int:
        return int(torch.multinomial(dist, 1, generator=self.generator))


def verify_tree(p_at, tree, draws: Draws, leniency: float = 1.0) -> tuple[list[int], int]:
    """One speculative-sampling step over a drafted tree (trees.DraftTree).

    p_at(row) -> the backbone's warped distribution (V,) at row 0 (after x) or 1 + v (after node v),
    asked for only on the rows the walk visits. `tree.proposals[u]` is the (V,) distribution u's
    children were drawn from without replacement, in node order (u = -1: the root); a node without
    one had its children chosen outright (a point mass each). Returns (the kept path's node indices,
    root first; the token committed after it).

    `leniency` < 1 is the lossy relaxation (relaxed mode under sampling): a draft is tested against
    leniency x its proposal, min(1, p(x) / (leniency q(x))), and a rejection draws from
    max(0, p - leniency q); 1 is the lossless rule."""
    children: dict[int, list[int]] = {}
    for v, u in enumerate(tree.parents):
        children.setdefault(u, []).append(v)
    path, u, target = [], -1, p_at(0)
    while True:
        q = tree.proposals.get(u)
        kept = None
        for v in children.get(u, ()):
            x = tree.tokens[v]
            if q is None:  # chosen outright: a point mass at x, kept with probability target(x)
                if draws.coin(torch.clamp(target[x] / leniency, max=1.0)):
                    kept = v
                    break
                target = _less_at(target, x, leniency)
            else:
                if draws.coin(accept_chance(target[x], leniency * q[x].clamp(min=1e-30))):
                    kept = v
                    break
                target, q = residual(target, leniency * q), _without(q, x)
        if kept is None:
            return path, draws.draw(target)
        path.append(kept)
        u, target = kept, p_at(1 + kept)


def _less_at(dist: torch.Tensor, token: int, mass: float) -> torch.Tensor:
    """max(0, dist - mass at `token`), renormalised: the residual after a point mass (mass 1: `dist`
    without `token`). A rejection there has dist(token) < mass, so something is left."""
    out = dist.clone()
    out[token] = torch.clamp(out[token] - mass, min=0.0)
    return out / out.sum()
