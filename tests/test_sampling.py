"""Speculative sampling's pieces (mtp_train/decoding/sampling.py): the warpers against HF's own
logits processors, and the chain rule shown lossless exactly (every draft outcome enumerated with
its probability) and statistically (seeded samples, a test at a false-alarm rate of 1e-4), each
also shown to fail on a deliberately wrong rule."""

from __future__ import annotations

import itertools
import math

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


# --- trees: several children per node, drawn or chosen outright -----------------------------------

W = 4  # a smaller vocabulary: every drafted tree and every verification outcome is enumerated


class _Branch(Exception):
    def __init__(self, options):
        self.options = options


class _Replay(sampling.Draws):
    """Draws that replay a list of choices and stop at the first choice not yet made, with its
    options, so that a driver can walk every outcome of verification with its probability."""

    def __init__(self, choices):
        self.choices, self.i, self.prob = choices, 0, 1.0

    def _next(self, options):
        if self.i == len(self.choices):
            raise _Branch(options)
        value = self.choices[self.i]
        self.i += 1
        self.prob *= dict(options)[value]
        return value

    def coin(self, chance):
        c = min(1.0, float(chance))
        return self._next([(True, c), (False, 1.0 - c)])

    def draw(self, dist):
        return self._next([(x, float(dist[x])) for x in range(len(dist)) if dist[x] > 0])


def _outcomes(run):
    """Every (result, probability) of run(draws), exactly."""
    stack = [[]]
    while stack:
        choices = stack.pop()
        draws = _Replay(choices)
        try:
            result = run(draws)
        except _Branch as b:
            stack.extend(choices + [v] for v, pr in b.options if pr > 0)
            continue
        yield result, draws.prob


def _ordered_draws(q: torch.Tensor, m: int):
    """Every ordered draw of m distinct tokens from q without replacement, with its probability
    (fewer where q has fewer tokens, as sampling.DraftSampler draws)."""
    m = min(m, int((q > 0).sum()))

    def rec(left, prefix, prob):
        if len(prefix) == m:
            yield prefix, prob
            return
        for x in range(len(left)):
            if left[x] > 0:
                yield from rec(torch.cat([left[:x], torch.zeros(1, dtype=left.dtype), left[x + 1:]]) / (1 - left[x]),
                               prefix + [x], prob * float(left[x]))
    yield from rec(q / q.sum(), [], 1.0)


def _tree_tables(seed: int, w: Warpers):
    """p0 (W,), p1 (W, W): the backbone after x and after each first token; q0, q1 likewise for the
    heads; all warped by `w`, in float64."""
    g = torch.Generator().manual_seed(seed)

    def dist(*shape):
        d = w.probs(torch.randn(*shape, W, generator=g, dtype=torch.float64) * 2).double()
        return d / d.sum(-1, keepdim=True)

    return dist(), dist(W), dist(), dist(W)


def _tree_joint(p0, p1, q0, q1, how: str) -> torch.Tensor:
    """The exact distribution (W, W) of the first two tokens one verify_tree step commits (a step
    that commits one token is followed by a draw from p at it), on a tree whose root has two
    children and whose first child has two children and second one; `how`: children "drawn" from q
    without replacement, chosen "outright" (the top two of q), or "mixed" (drawn at the root, then
    chosen)."""
    from mtp_train.trees import DraftTree

    def children(q, m, drawn):
        if drawn:
            yield from _ordered_draws(q, m)
        else:
            yield q.topk(m).indices.tolist(), 1.0

    out = torch.zeros(W, W, dtype=torch.float64)
    for root, pr_root in children(q0, 2, how != "outright"):
        below = [list(children(q1[x], 2 - i, how == "drawn")) for i, x in enumerate(root)]
        for picks in itertools.product(*below):
            t = DraftTree()
            for x in root:
                t.add(x, -1, 0.0, 1.0)
            for i, (kids, _) in enumerate(picks):
                for x in kids:
                    t.add(x, i, 0.0, 1.0)
            if how != "outright":
                t.proposals[-1] = q0
            if how == "drawn":
                t.proposals.update({i: q1[x] for i, x in enumerate(root)})
            rows = [p0, *(p1[x] for x in root)] + [p0] * (t.n - len(root))  # depth 2: the third token's

            def run(draws, t=t, rows=rows):
                return sampling.verify_tree(rows.__getitem__, t, draws)

            weight = pr_root * math.prod(pr for _, pr in picks)
            for (path, token), pr in _outcomes(run):
                toks = [t.tokens[v] for v in path] + [token]
                if len(toks) >= 2:
                    out[toks[0], toks[1]] += weight * pr
                else:
                    out[toks[0]] += weight * pr * p1[toks[0]]
    return out


@pytest.mark.parametrize("how", ["drawn", "outright", "mixed"])
@pytest.mark.parametrize("w", [Warpers(), Warpers(temperature=0.7, top_p=0.9)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_tree_step_emits_exactly_the_backbones_distribution(how, w, seed):
    p0, p1, q0, q1 = _tree_tables(seed, w)
    torch.testing.assert_close(_tree_joint(p0, p1, q0, q1, how), p0[:, None] * p1, atol=1e-9, rtol=0)


@pytest.mark.parametrize("wrong,how", [("accept when q >= p", "drawn"), ("skip the residual", "drawn"),
                                       ("keep q after a rejected sibling", "drawn"),
                                       ("test chosen children as drawn", "outright")])
def test_the_exact_tree_check_fails_on_a_wrong_rule(wrong, how, monkeypatch):
    p0, p1, q0, q1 = _tree_tables(4, Warpers())
    if wrong == "accept when q >= p":
        monkeypatch.setattr(sampling, "accept_chance", lambda p, q: (q >= p).double())
    elif wrong == "skip the residual":
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    elif wrong == "keep q after a rejected sibling":  # the next sibling tested against q itself
        monkeypatch.setattr(sampling, "_without", lambda d, x: d)
    else:  # children chosen outright (the top two) but tested as if drawn: min(1, p/q) instead of p
        real_verify = sampling.verify_tree

        def as_drawn(p_at, tree, draws):
            tree.proposals.setdefault(-1, q0)
            return real_verify(p_at, tree, draws)

        monkeypatch.setattr(sampling, "verify_tree", as_drawn)
    got = _tree_joint(p0, p1, q0, q1, how)
    assert (got - p0[:, None] * p1).abs().max() > 1e-3


# --- end to end: the decoder's samples against HF generate(do_sample=True) ------------------------

N_SAMPLES, NEW = 2000, 4


def _exact_first_tokens(bb, prompt, w: Warpers, n: int) -> dict[tuple, float]:
    """The backbone's exact warped distribution over its first n sampled tokens (teacher-forced,
    every continuation with non-zero probability)."""
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, pr in out.items():
            with torch.inference_mode():
                logits = bb.model(torch.tensor([prompt + list(seq)])).logits[0, -1]
            probs = w.probs(logits).double()
            for x in torch.nonzero(probs).flatten().tolist():
                nxt[seq + (x,)] = pr * float(probs[x])
        out = nxt
    return out


def _ours(dec, prompt, w, source, n_samples=N_SAMPLES) -> tuple[list[tuple], float]:
    """n seeded decodes -> (their first NEW tokens, the mean tokens committed per step)."""
    from mtp_train.decoding.acceptance import RejectionSampling
    from mtp_train.decoding.plans import Sampled
    from mtp_train.decoding.sampling import DraftSampler

    out, lengths = [], []
    for i in range(n_samples):
        g = torch.Generator().manual_seed(i)
        res = dec.generate(prompt, NEW, Sampled(source, DraftSampler(w, g, vocab=dec.weight.shape[0])),
                           RejectionSampling(w, g))
        out.append(tuple(res.tokens))
        lengths += res.accept_lengths
    return out, sum(lengths) / len(lengths)


def _hf(bb, prompt, w, n_samples=N_SAMPLES) -> list[tuple]:
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=True, temperature=w.temperature, top_k=w.top_k or None, top_p=w.top_p,
                          min_p=w.min_p, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
    ids = torch.tensor([prompt])
    out = []
    for i in range(n_samples):
        torch.manual_seed(i)
        with torch.inference_mode():
            seq = bb.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        out.append(tuple(seq[0, len(prompt):].tolist()))
    return out


def _counts(samples, cells) -> torch.Tensor:
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1)
    for s in samples:
        counts[index.get(s, len(cells))] += 1  # the last cell: a sequence the backbone cannot emit
    return counts


def _two_sample_rejects(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Pearson's test that two count vectors come from one distribution, false-alarm rate 1e-4
    (cells with fewer than 10 samples in both pooled)."""
    both = a + b
    big = both >= 10
    a = torch.cat([a[big], a[~big].sum()[None]]).double()
    b = torch.cat([b[big], b[~big].sum()[None]]).double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    stat = float(((a - na * pooled) ** 2 / (na * pooled) + (b - nb * pooled) ** 2 / (nb * pooled)).sum())
    return stat > _chi2_critical(len(a) - 1, 1e-4)


@pytest.fixture(scope="module")
def sampled_setup(tiny_backbone):
    """The tiny backbone, a prompt, warpers that leave a few tokens per step, the exact distribution
    of the first NEW tokens and HF generate's samples of them."""
    w = Warpers(temperature=0.7, top_k=3)
    prompt = [5, 17, 42, 99, 7]
    exact = _exact_first_tokens(tiny_backbone, prompt, w, NEW)
    cells = sorted(exact)
    return w, prompt, cells, torch.tensor([exact[c] for c in cells] + [0.0]), _counts(
        _hf(tiny_backbone, prompt, w), cells)


def _noisy_heads(bb, typ, seed=0, noise=0.3):
    from mtp_train.config import HeadsConfig
    from mtp_train.heads.persist import build_heads

    torch.manual_seed(seed)
    heads = build_heads(HeadsConfig(type=typ, k=3), bb)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * noise)  # away from the backbone: the residual matters
    return heads.eval()


@pytest.mark.integration
@pytest.mark.parametrize("typ,plan,noise", [("medusa", "chain", 0.1), ("chained", "tree", 0.05),
                                            ("medusa", "dynamic", 0.05)])
def test_sampled_decoding_matches_hf_generate_do_sample(tiny_backbone, sampled_setup, typ, plan, noise):
    from mtp_train.decoding import Decoder, DynamicTree
    from mtp_train.decoding.plans import Chain, Tree
    from mtp_train.trees import TreeShape

    w, prompt, cells, exact, hf = sampled_setup
    assert not _chi2_rejects(hf[:-1].reshape(1, -1), exact[:-1].reshape(1, -1))  # HF's warpers are ours
    source = {"chain": Chain(), "tree": Tree(TreeShape.of([(0,), (1,), (0, 0), (0, 1), (1, 0)])),
              "dynamic": Tree(DynamicTree(nodes=6, topk=2, width=2))}[plan]
    dec = Decoder(tiny_backbone, _noisy_heads(tiny_backbone, typ, noise=noise), eos_ids=[])
    samples, tau = _ours(dec, prompt, w, source)
    assert tau > 1.2  # drafts were kept: the check is about verification, not the backbone alone
    ours = _counts(samples, cells)
    assert ours[-1] == 0  # never a sequence the backbone's warped distribution excludes
    assert not _two_sample_rejects(ours, hf)
    assert not _chi2_rejects(ours[:-1].reshape(1, -1), exact[:-1].reshape(1, -1))


@pytest.mark.integration
def test_the_statistical_check_fails_on_a_wrong_rule(tiny_backbone, sampled_setup, monkeypatch):
    from mtp_train.decoding import Decoder
    from mtp_train.decoding.plans import Tree
    from mtp_train.trees import TreeShape

    w, prompt, cells, exact, hf = sampled_setup
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)  # a rejection draws from p itself
    dec = Decoder(tiny_backbone, _noisy_heads(tiny_backbone, "medusa", noise=0.1), eos_ids=[])
    ours = _counts(_ours(dec, prompt, w, Tree(TreeShape.of([(0,), (1,), (0, 0)])))[0], cells)
    assert _two_sample_rejects(ours, hf)
