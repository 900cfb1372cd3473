"""Speculative sampling's pieces, as pure tensor functions (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling").

    Warpers          temperature, top-k, top-p and min-p as HF's GenerationConfig applies them
                     (in that order, the same ties kept), to the backbone's p and the drafts' q alike
    accept_chance    a draft x sampled from q is kept with probability min(1, p(x) / q(x))
    residual         on a rejection the token comes from max(0, p - q), normalised
    verify_chain     one chain step: keep drafts while they pass, then a token from the residual,
                     or, after a fully kept chain, a bonus token from p

Why it is lossless: the token emitted at a depth is x with probability q(x) min(1, p(x)/q(x)) +
(1 - sum_y min(p(y), q(y))) * residual(x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x), and a kept
draft leaves the next depth in the same situation one token on (docs/decoding.md). The decoder does
not use these yet; tests/test_sampling.py checks them exactly by enumeration.
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
