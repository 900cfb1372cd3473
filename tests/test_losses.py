"""Draft-head losses (Medusa CE: Cai et al. 2024; DeepSeek-V3 MTP; TV and end-to-end TV: Bebop, Qwen
team 2026) against slow references written as explicit loops over b, t, j and v.

The references use scalar torch ops in float64 so that both values and gradients can be compared.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mtp_train.losses import (
    LOSSES,
    acceptance,
    ce_loss,
    compute_loss,
    e2e_tv_loss,
    greedy_agreement,
    kl_loss,
    tv_loss,
)

B, T, K, V = 2, 5, 3, 7
NEG = -1e4  # exp(NEG - max) underflows to exactly 0 in float32 and float64: a zero probability


# ---------------------------------------------------------------------------------------------------
# inputs


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, K, V, generator=g, dtype=torch.float64).mul(2).to(dtype)
    teacher = torch.randn(B, T, K, V, generator=g, dtype=torch.float64).mul(2).to(dtype)
    targets = torch.randint(0, V, (B, T, K), generator=g)
    return logits.requires_grad_(True), teacher, targets


def _mask(kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "ones":
        return torch.ones(B, T, K, dtype=torch.bool)
    if kind == "bool":
        return torch.rand(B, T, K, generator=g) < 0.6
    if kind == "float":
        return (torch.rand(B, T, K, generator=g) < 0.5).float()
    if kind == "empty_depth":  # depth 2 has no valid position at all
        m = torch.rand(B, T, K, generator=g) < 0.7
        m[:, :, 1] = False
        return m
    if kind == "none":
        return torch.zeros(B, T, K, dtype=torch.bool)
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------------------
# slow references: loops over b, t, j (and v), scalar arithmetic only


def _ref_softmax(row):
    exps = [torch.exp(row[v]) for v in range(len(row))]
    z = sum(exps)
    return [e / z for e in exps]


def _ref_per_position(name, logits, teacher, targets):
    """nested list [b][t][j] of scalar per-position values (loss, or alpha for 'alpha')."""
    out = []
    for b in range(B):
        rows = []
        for t in range(T):
            cells = []
            for j in range(K):
                q = _ref_softmax(logits[b, t, j])
                if name == "ce":
                    cells.append(-torch.log(q[int(targets[b, t, j])]))
                    continue
                p = [x.detach() for x in _ref_softmax(teacher[b, t, j].detach())]
                if name == "kl":
                    cells.append(sum(p[v] * (torch.log(p[v]) - torch.log(q[v])) for v in range(V)))
                else:  # alpha
                    cells.append(sum(torch.minimum(p[v], q[v]) for v in range(V)))
            rows.append(cells)
        out.append(rows)
    return out


def _ref_reduce(per_pos, mask, weights):
    m = mask.double().tolist()
    w = [1.0] * K if weights is None else list(weights)
    per_depth = []
    for j in range(K):
        num, den = 0.0, 0.0
        for b in range(B):
            for t in range(T):
                num = num + m[b][t][j] * per_pos[b][t][j]
                den = den + m[b][t][j]
        per_depth.append(num / den if den > 0 else torch.zeros((), dtype=torch.float64))
        if den == 0:  # a depth with no target in the batch takes no part in the average
            w[j] = 0.0
    if sum(w) == 0:
        return torch.zeros((), dtype=torch.float64), per_depth
    loss = sum(w[j] * per_depth[j] for j in range(K)) / sum(w)
    return loss, per_depth


def _ref_loss(name, logits, teacher, targets, mask, weights):
    if name in ("ce", "kl"):
        return _ref_reduce(_ref_per_position(name, logits, teacher, targets), mask, weights)
    alpha = _ref_per_position("alpha", logits, teacher, targets)
    if name == "tv":
        miss = [[[1 - alpha[b][t][j] for j in range(K)] for t in range(T)] for b in range(B)]
        return _ref_reduce(miss, mask, weights)
    # e2e_tv: chain acceptance A_{t,j} = prod_{i<=j} alpha_{t,i}
    chain = []
    for b in range(B):
        rows = []
        for t in range(T):
            prod, cells = 1.0, []
            for j in range(K):
                prod = prod * alpha[b][t][j]
                cells.append(prod)
            rows.append(cells)
        chain.append(rows)
    m = mask.double().tolist()
    w = [1.0] * K if weights is None else list(weights)
    num, den = 0.0, 0.0
    for b in range(B):
        for t in range(T):
            for j in range(K):
                num = num + m[b][t][j] * w[j] * chain[b][t][j]
                den = den + m[b][t][j] * w[j]
    loss = 1 - num / den if den > 0 else torch.zeros((), dtype=torch.float64)
    miss = [[[1 - chain[b][t][j] for j in range(K)] for t in range(T)] for b in range(B)]
    _, per_depth = _ref_reduce(miss, mask, weights)
    return loss, per_depth


def _run(name, logits, teacher, targets, mask, weights):
    if name == "ce":
        return ce_loss(logits, targets, mask, weights)
    return {"kl": kl_loss, "tv": tv_loss, "e2e_tv": e2e_tv_loss}[name](logits, teacher, mask, weights)


# ---------------------------------------------------------------------------------------------------
# against the references


@pytest.mark.parametrize("weights", [None, (1.0, 0.5, 0.25), (0.0, 2.0, 1.0)])
@pytest.mark.parametrize("mask_kind", ["ones", "bool", "float", "empty_depth"])
@pytest.mark.parametrize("name", LOSSES)
def test_loss_matches_slow_reference_in_value_and_gradient(name, mask_kind, weights):
    logits, teacher, targets = _inputs(seed=10 * LOSSES.index(name) + len(mask_kind))
    mask = _mask(mask_kind)

    out = _run(name, logits, teacher, targets, mask, weights)
    (grad,) = torch.autograd.grad(out.loss, logits)

    ref_loss, ref_per_depth = _ref_loss(name, logits, teacher, targets, mask, weights)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)

    assert out.loss.shape == () and out.per_depth.shape == (K,)
    torch.testing.assert_close(out.loss, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.per_depth.detach(), torch.stack(ref_per_depth).detach(),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", ["tv", "e2e_tv"])
def test_tv_losses_report_masked_mean_acceptance_per_depth(name):
    logits, teacher, targets = _inputs(seed=3)
    mask = _mask("bool")
    alpha = _ref_per_position("alpha", logits, teacher, targets)
    m = mask.double().tolist()
    expected = []
    for j in range(K):
        num = sum(m[b][t][j] * alpha[b][t][j].detach().item() for b in range(B) for t in range(T))
        expected.append(num / sum(m[b][t][j] for b in range(B) for t in range(T)))
    out = _run(name, logits, teacher, targets, mask, None)
    torch.testing.assert_close(out.alpha, torch.tensor(expected, dtype=torch.float64))
    assert not out.alpha.requires_grad


def test_ce_and_kl_report_no_acceptance():
    logits, teacher, targets = _inputs()
    mask = _mask("ones")
    assert ce_loss(logits, targets, mask).alpha is None
    assert kl_loss(logits, teacher, mask).alpha is None


def test_acceptance_and_greedy_agreement_match_loops():
    logits, teacher, targets = _inputs(seed=5)
    teacher[0, 0, 0] = logits[0, 0, 0].detach() + 1.0  # at least one agreement
    alpha = acceptance(logits, teacher)
    agree = greedy_agreement(logits, teacher)
    assert alpha.shape == agree.shape == (B, T, K) and agree.dtype == torch.bool
    ref = _ref_per_position("alpha", logits, teacher, targets)
    for b in range(B):
        for t in range(T):
            for j in range(K):
                assert math.isclose(alpha[b, t, j].item(), ref[b][t][j].item(), rel_tol=1e-12)
                s, p = logits[b, t, j].tolist(), teacher[b, t, j].tolist()
                assert agree[b, t, j].item() == (s.index(max(s)) == p.index(max(p)))
    assert agree.any() and not agree.all()


# ---------------------------------------------------------------------------------------------------
# masking edge cases and gradient routing


@pytest.mark.parametrize("name", LOSSES)
def test_all_masked_gives_exact_zero_and_zero_finite_gradients(name):
    logits, teacher, targets = _inputs(seed=7)
    out = _run(name, logits, teacher, targets, _mask("none"), (1.0, 0.5, 0.25))
    assert out.loss.item() == 0.0
    assert torch.equal(out.per_depth.detach(), torch.zeros(K, dtype=out.per_depth.dtype))
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert torch.isfinite(grad).all() and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", LOSSES)
def test_masked_positions_do_not_affect_the_loss(name):
    logits, teacher, targets = _inputs(seed=8)
    # Prefix-shaped like the AdaMTP masks: depth j counts only if all shallower depths do, so the
    # chain product of e2e_tv never reads a masked depth either.
    lengths = torch.randint(0, K + 1, (B, T), generator=torch.Generator().manual_seed(8))
    mask = torch.arange(K) < lengths.unsqueeze(-1)  # (B, T, K)
    assert mask.any() and not mask.all()
    base = _run(name, logits, teacher, targets, mask, None).loss
    hidden = ~mask.unsqueeze(-1)  # (B, T, K, 1)
    logits2 = torch.where(hidden, torch.full_like(logits, 50.0), logits)
    teacher2 = torch.where(hidden, torch.full_like(teacher, -30.0), teacher)
    targets2 = torch.where(mask, targets, torch.full_like(targets, -100))  # a padding id
    changed = _run(name, logits2, teacher2, targets2, mask, None).loss
    torch.testing.assert_close(changed, base)


@pytest.mark.parametrize("name", LOSSES)
def test_gradient_reaches_logits_but_not_teacher(name):
    logits, teacher, targets = _inputs(seed=9)
    teacher.requires_grad_(True)
    out = _run(name, logits, teacher, targets, _mask("bool"), None)
    assert out.loss.requires_grad
    out.loss.backward()
    assert teacher.grad is None
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------
# hand-made acceptances


def _pair(alpha: float):
    """(student, teacher) logits over V=4 whose acceptance sum_v min(p, q) is exactly alpha."""
    half = [0.0, 0.0, NEG, NEG]  # p = (1/2, 1/2, 0, 0)
    if alpha == 1.0:
        return half, half
    if alpha == 0.5:
        return [NEG, 0.0, 0.0, NEG], half  # q = (0, 1/2, 1/2, 0): overlap 1/2
    if alpha == 0.0:
        return [NEG, NEG, 0.0, 0.0], half  # disjoint supports
    raise AssertionError(alpha)


ALPHAS = [[1.0, 1.0, 1.0], [0.5, 0.5, 1.0], [1.0, 0.0, 1.0], [0.5, 1.0, 0.5], [0.0, 1.0, 1.0]]


def _handmade():
    rows = [[_pair(a) for a in row] for row in ALPHAS]
    student = torch.tensor([[[s for s, _ in row] for row in rows]], dtype=torch.float32)
    teacher = torch.tensor([[[p for _, p in row] for row in rows]], dtype=torch.float32)
    return student.requires_grad_(True), teacher  # (1, 5, 3, 4) each


def test_handmade_pairs_have_the_intended_acceptance():
    student, teacher = _handmade()
    assert torch.equal(acceptance(student, teacher).detach(), torch.tensor([ALPHAS]))


def test_e2e_tv_is_one_minus_normalised_expected_accepted_length():
    student, teacher = _handmade()
    k = 3
    lengths = []
    for row in ALPHAS:  # E[accepted] = 1 + sum_j prod_{i<=j} alpha_i
        prod, length = 1.0, 1.0
        for a in row:
            prod *= a
            length += prod
        lengths.append(length)
    assert lengths == [4.0, 2.0, 2.0, 2.25, 1.0]
    mean_length = sum(lengths) / len(lengths)
    out = e2e_tv_loss(student, teacher, torch.ones(1, len(ALPHAS), k))
    assert out.loss.item() == pytest.approx(1 - (mean_length - 1) / k, abs=1e-7)
    assert out.alpha.tolist() == pytest.approx([0.6, 0.7, 0.9])
    # per depth: 1 - mean chain acceptance (chains: depth1 .6, depth2 (1+.25+0+.5+0)/5, depth3 .3)
    assert out.per_depth.tolist() == pytest.approx([0.4, 0.65, 1 - 1.5 / 5])


def test_tv_is_one_minus_alpha():
    student, teacher = _handmade()
    out = tv_loss(student, teacher, torch.ones(1, len(ALPHAS), 3))
    assert out.per_depth.tolist() == pytest.approx([0.4, 0.3, 0.1])
    assert out.loss.item() == pytest.approx(1 - (0.6 + 0.7 + 0.9) / 3)

    logits, teacher, _ = _inputs(seed=11)
    mask = _mask("float")
    out = tv_loss(logits, teacher, mask)
    torch.testing.assert_close(out.per_depth.detach(), 1 - out.alpha)
    l1 = (torch.softmax(logits, -1) - torch.softmax(teacher, -1)).abs().sum(-1)  # (B, T, K)
    torch.testing.assert_close(acceptance(logits, teacher), 1 - 0.5 * l1)


def test_kl_is_zero_for_identical_distributions_and_positive_otherwise():
    logits, teacher, _ = _inputs(seed=12)
    mask = _mask("ones")
    assert kl_loss(logits, logits.detach().clone(), mask).loss.item() == 0.0
    shifted = logits.detach() + 3.0  # same softmax
    assert kl_loss(logits, shifted, mask).loss.item() == pytest.approx(0.0, abs=1e-12)
    assert kl_loss(logits, teacher, mask).loss.item() > 0.01


def test_e2e_tv_with_identical_distributions_is_zero():
    logits, _, _ = _inputs(seed=13)
    out = e2e_tv_loss(logits, logits.detach(), _mask("bool"))
    assert out.loss.item() == pytest.approx(0.0, abs=1e-12)
    assert out.alpha.tolist() == pytest.approx([1.0] * K)


# ---------------------------------------------------------------------------------------------------
# dtype, dispatch, validation


@pytest.mark.parametrize("name", LOSSES)
def test_bf16_inputs_are_computed_in_float32(name):
    logits, teacher, targets = _inputs(seed=14, dtype=torch.bfloat16)
    mask = _mask("bool")
    out = _run(name, logits, teacher, targets, mask, None)
    assert out.loss.dtype == torch.float32
    ref = _run(name, logits.detach().float(), teacher.float(), targets, mask, None)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


@pytest.mark.parametrize("name", LOSSES)
def test_compute_loss_dispatches(name):
    logits, teacher, targets = _inputs(seed=15)
    mask = _mask("bool")
    got = compute_loss(name, logits, targets=targets, teacher_logits=teacher, mask=mask,
                       depth_weights=(1.0, 0.5, 0.25))
    want = _run(name, logits, teacher, targets, mask, (1.0, 0.5, 0.25))
    torch.testing.assert_close(got.loss, want.loss)


@pytest.mark.bad_input
def test_compute_loss_rejects_unknown_name_and_missing_inputs():
    logits, teacher, targets = _inputs()
    mask = _mask("ones")
    with pytest.raises(ValueError, match="'tvd'"):
        compute_loss("tvd", logits, teacher_logits=teacher, mask=mask)
    with pytest.raises(ValueError, match="targets"):
        compute_loss("ce", logits, teacher_logits=teacher, mask=mask)
    with pytest.raises(ValueError, match="teacher_logits"):
        compute_loss("kl", logits, targets=targets, mask=mask)


@pytest.mark.bad_input
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, -1.0, 1.0), (0.0, 0.0, 0.0)])
def test_bad_depth_weights_are_rejected(weights):
    logits, teacher, _ = _inputs()
    with pytest.raises(ValueError, match="depth_weights"):
        tv_loss(logits, teacher, _mask("ones"), weights)


@pytest.mark.bad_input
def test_shape_mismatches_are_rejected():
    logits, teacher, targets = _inputs()
    with pytest.raises(ValueError, match="mask"):
        kl_loss(logits, teacher, torch.ones(B, T, K + 1))
    with pytest.raises(ValueError, match="teacher_logits"):
        kl_loss(logits, teacher[:, :-1], _mask("ones"))
    with pytest.raises(ValueError, match="targets"):
        ce_loss(logits, targets[..., :-1], _mask("ones"))


# ---------------------------------------------------------------------------------------------------
# teacher given as log-probabilities (draft vocabulary: p restricted to |D| tokens, sums to < 1)


def test_teacher_logprobs_on_a_draft_vocabulary_use_the_unrenormalised_p():
    logits, teacher, targets = _inputs(seed=7)  # teacher: logits over the full vocabulary
    full_logp = torch.log_softmax(teacher, -1)
    draft = torch.tensor([0, 2, 3])  # a vocabulary subset
    sub = full_logp[..., draft]  # (B, T, K, 3) sums to < 1
    q_sub = logits[..., draft]
    alpha = acceptance(q_sub, sub, teacher_logprobs=True)
    p, q = sub.exp(), torch.softmax(q_sub, -1)
    for b in range(B):  # slow reference: sum over the draft tokens of min(p_full(v), q(v))
        for t in range(T):
            for j in range(K):
                ref = sum(min(p[b, t, j, v].item(), q[b, t, j, v].item()) for v in range(3))
                assert math.isclose(alpha[b, t, j].item(), ref, rel_tol=1e-12)
    # with the full vocabulary, log-probabilities and logits are the same teacher
    m = torch.ones(B, T, K)
    for name in ("kl", "tv", "e2e_tv"):
        a = compute_loss(name, logits, teacher_logits=teacher, mask=m).loss
        b_ = compute_loss(name, logits, teacher_logits=full_logp, mask=m, teacher_logprobs=True).loss
        assert math.isclose(a.item(), b_.item(), rel_tol=1e-10)
    # KL with a sub-normalised p is minimised by q = p / Z (the renormalised restriction)
    best = compute_loss("kl", torch.log_softmax(sub, -1), teacher_logits=sub, mask=m,
                        teacher_logprobs=True).loss
    other = compute_loss("kl", q_sub, teacher_logits=sub, mask=m, teacher_logprobs=True).loss
    assert best < other


def test_topk_loss_matches_a_per_position_loop_and_its_gradient():
    from mtp_train.losses import topk_loss

    torch.manual_seed(3)
    logits = torch.randn(2, 3, 2, 11, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 2, 11, dtype=torch.float64)
    mask = torch.rand(2, 3, 2) > 0.3
    out = topk_loss(logits, teacher, mask, topk=4)
    per = torch.zeros(2, 3, 2, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            for j in range(2):
                p = torch.softmax(teacher[b, t, j], -1)
                top = sorted(range(11), key=lambda v: -p[v].item())[:4]
                z = sum(p[v] for v in top)
                logq = torch.log_softmax(logits[b, t, j], -1)
                per[b, t, j] = -sum(p[v] / z * logq[v] for v in top)
    ref = torch.stack([per[..., j][mask[..., j]].mean() for j in range(2)])
    torch.testing.assert_close(out.per_depth, ref)
    torch.testing.assert_close(out.loss, ref.mean())
    g, = torch.autograd.grad(out.loss, logits)
    g_ref, = torch.autograd.grad(ref.mean(), logits)
    torch.testing.assert_close(g, g_ref)
    # K = V is the full cross-entropy to p, i.e. KL + H(p): equal gradients with kl_loss
    full = topk_loss(logits, teacher, mask, topk=11)
    kl = kl_loss(logits, teacher, mask)
    torch.testing.assert_close(torch.autograd.grad(full.loss, logits)[0], torch.autograd.grad(kl.loss, logits)[0])


def _sampled_alpha_by_loop(full_logits, draft, head_logits, t):
    """sum_x min(p_T, q_T) position by position, token by token, in float64: p_T(x) = p(x)^(1/T) /
    sum_v p(v)^(1/T) over the whole vocabulary, x over the draft vocabulary `draft`."""
    out = torch.zeros(head_logits.shape[:-1], dtype=torch.float64)
    for idx in itertools.product(*(range(n) for n in head_logits.shape[:-1])):
        z = full_logits[idx].double().tolist()
        p = [math.exp(v / t) for v in z]
        p = [v / sum(p) for v in p]
        q = [math.exp(v / t) for v in head_logits[idx].double().tolist()]
        q = [v / sum(q) for v in q]
        out[idx] = sum(min(p[x], q[i]) for i, x in enumerate(draft))
    return out


@pytest.mark.parametrize("t", [0.5, 0.7, 1.0, 1.5])
def test_sampled_acceptance_equals_a_token_by_token_loop(t):
    from mtp_train.losses import sampled_acceptance
    from mtp_train.teacher import tempered_log_norms

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 7, generator=g) * 2  # the heads' scores of 7 draft tokens
    full = torch.randn(3, 2, 9, generator=g) * 2  # the backbone's logits over V = 9
    draft = [0, 2, 3, 4, 6, 7, 8]
    teacher = torch.log_softmax(full, -1)[..., draft]
    norm = tempered_log_norms(torch.logsumexp(full, -1), [t], logits=full)[0]
    got = sampled_acceptance(logits, teacher, t, norm)
    torch.testing.assert_close(got.double(), _sampled_alpha_by_loop(full, draft, logits, t), atol=1e-5, rtol=0)
    whole = sampled_acceptance(full, torch.log_softmax(full, -1), t)  # the whole vocabulary, q == p
    torch.testing.assert_close(whole, torch.ones_like(whole), atol=1e-5, rtol=0)  # always kept
    if t != 1.0:  # the temperature is applied, and the whole vocabulary's normaliser is what it needs
        assert (got - sampled_acceptance(logits, teacher, 1.0, torch.zeros_like(norm))).abs().max() > 1e-3
        assert (got - sampled_acceptance(logits, teacher, t)).abs().max() > 1e-3  # renormalised over D only
