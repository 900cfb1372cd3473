"""Speculative sampling's pieces (mtp_train/decoding/sampling.py): the warpers against HF's own
logits processors, and the chain rule shown lossless exactly (every draft outcome enumerated with
its probability) and statistically (seeded samples, a test at a false-alarm rate of 1e-4), each
also shown to fail on a deliberately wrong rule."""

from __future__ import annotations

import pytest
import torch

from mtp_train.decoding import sampling
from mtp_train.decoding.sampling import Warpers, accept_chance, residual, verify_chain

V = 5


def _hf_warped(logits: torch.Tensor, w: Warpers) -> torch.Tensor:
    """The same warpers through transformers' processors, in the order HF generate applies them."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if w.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(w.temperature))
    if w.top_k:
        procs.append(TopKLogitsWarper(w.top_k))
    if w.top_p < 1.0:
        procs.append(TopPLogitsWarper(w.top_p))
    if w.min_p is not None:
        procs.append(MinPLogitsWarper(w.min_p))
    return procs(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.float())


@pytest.mark.parametrize("w", [Warpers(), Warpers(temperature=0.7), Warpers(top_k=3), Warpers(top_p=0.8),
                               Warpers(temperature=0.6, top_k=20, top_p=0.95), Warpers(min_p=0.1),
                               Warpers(temperature=1.3, top_p=0.5, min_p=0.05), Warpers(top_k=1)])
def test_warpers_match_hf_generates_processors(w):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    logits[:8, :10] = 1.5  # ties, where top-k and top-p must keep what HF keeps
    ours, hf = w.logits(logits), _hf_warped(logits, w)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    torch.testing.assert_close(ours[~torch.isinf(ours)], hf[~torch.isinf(hf)])
    torch.testing.assert_close(w.probs(logits), hf.softmax(-1))


@pytest.mark.bad_input
@pytest.mark.parametrize("kw,key", [({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"),
                                    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                    ({"min_p": 2.0}, "min_p")])
def test_bad_warpers_are_refused_naming_the_setting(kw, key):
    with pytest.raises(ValueError, match=rf"^{key}: must be"):
        Warpers(**kw)


def _tables(seed: int, w: Warpers):
    """A target p and a draft q over V tokens that depend on the prefix (two depths deep), both
    warped by `w`: p0 (V,), p1[x1] (V, V), q0 (V,), q1[d1] (V, V)."""
    g = torch.Generator().manual_seed(seed)
    def dist(*shape):  # renormalised in float64, so that the check's only error is float64's
        d = w.probs(torch.randn(*shape, V, generator=g, dtype=torch.float64) * 2).double()
        return d / d.sum(-1, keepdim=True)

    return dist(), dist(V), dist(), dist(V)


def _emitted_joint(p0, p1, q0, q1, accept=accept_chance, resid=residual) -> torch.Tensor:
    """The exact distribution (V, V) of the first two tokens a chain step of two drafts commits,
    every draft outcome enumerated with its probability. A step that commits one token is followed
    by a step that draws the next from p (which this test shows lossless too)."""
    out = torch.zeros(V, V, dtype=torch.float64)
    r0 = resid(p0, q0)
    for d1 in range(V):
        if q0[d1] == 0:
            continue  # never drafted
        a1 = accept(p0[d1], q0[d1])
        out += q0[d1] * (1 - a1) * r0[:, None] * p1  # rejected: x1 from the residual, x2 from p
        r1 = resid(p1[d1], q1[d1])
        for d2 in range(V):
            if q1[d1, d2] == 0:
                continue
            a2 = accept(p1[d1, d2], q1[d1, d2])
            out[d1] += q0[d1] * a1 * q1[d1, d2] * (1 - a2) * r1  # d1 kept, d2 rejected
            out[d1, d2] += q0[d1] * a1 * q1[d1, d2] * a2  # both kept (the bonus token comes third)
    return out


@pytest.mark.parametrize("w", [Warpers(), Warpers(temperature=0.7, top_k=3), Warpers(top_p=0.7)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_chain_step_emits_exactly_the_backbones_distribution(w, seed):
    p0, p1, q0, q1 = _tables(seed, w)
    got = _emitted_joint(p0, p1, q0, q1)
    torch.testing.assert_close(got, p0[:, None] * p1, atol=1e-9, rtol=0)


@pytest.mark.parametrize("wrong", ["accept when q >= p", "skip the residual"])
def test_the_exact_check_fails_on_a_wrong_rule(wrong):
    p0, p1, q0, q1 = _tables(3, Warpers())
    if wrong == "accept when q >= p":
        got = _emitted_joint(p0, p1, q0, q1, accept=lambda p, q: (q >= p).double())
    else:  # a rejection draws from p instead of the residual
        got = _emitted_joint(p0, p1, q0, q1, resid=lambda p, q: p)
    assert (got - p0[:, None] * p1).abs().max() > 1e-3


def _first_two(p0, p1, q0, q1, n: int, seed: int, rule=verify_chain) -> torch.Tensor:
    """Counts (V, V) of the first two committed tokens over n seeded chain steps of two drafts."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        d1 = int(torch.multinomial(q0.float(), 1, generator=g))
        d2 = int(torch.multinomial(q1[d1].float(), 1, generator=g))
        p = torch.stack([p0, p1[d1], p1[d1]]).float()  # p after d2 is not read for two tokens
        kept, token = rule(p, torch.stack([q0, q1[d1]]).float(), torch.tensor([d1, d2]), g)
        if kept == 0:
            x1, x2 = token, int(torch.multinomial(p1[token].float(), 1, generator=g))
        else:
            x1, x2 = d1, (token if kept == 1 else d2)
        counts[x1, x2] += 1
    return counts


def _chi2_rejects(counts: torch.Tensor, want: torch.Tensor) -> bool:
    """Pearson's test of the counts against `want`, at a false-alarm rate of 1e-4 (cells expected
    below 5 pooled)."""
    n = counts.sum()
    expected = (want * n).flatten().double()
    observed = counts.flatten().double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    stat = float(((o - e) ** 2 / e.clamp(min=1e-12)).sum())
    return stat > _chi2_critical(len(e) - 1, 1e-4)


def _chi2_critical(df: int, alpha: float) -> float:
    """c with P(chi2_df > c) = alpha, by bisection on the regularised upper incomplete gamma."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        tail = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                             torch.tensor(mid / 2, dtype=torch.float64)))
        lo, hi = (mid, hi) if tail > alpha else (lo, mid)
    return (lo + hi) / 2


def test_the_chi2_critical_value_is_the_textbook_one():
    assert _chi2_critical(3, 1e-4) == pytest.approx(21.108, abs=1e-3)
    assert _chi2_critical(1, 0.05) == pytest.approx(3.8415, abs=1e-4)


def test_sampled_chain_steps_follow_the_backbones_distribution_and_a_wrong_rule_does_not(monkeypatch):
    w = Warpers(temperature=0.8, top_k=4)
    p0, p1, q0, q1 = _tables(5, w)
    want = p0[:, None] * p1
    assert not _chi2_rejects(_first_two(p0, p1, q0, q1, 4000, seed=0), want)
    monkeypatch.setattr(sampling, "accept_chance", lambda p, q: (q >= p).float())
    assert _chi2_rejects(_first_two(p0, p1, q0, q1, 4000, seed=0), want)
