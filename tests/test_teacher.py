"""Backbone stats and depth-aligned teacher log-probabilities against slow references."""

from __future__ import annotations

import torch

from mtp_train.depth_targets import teacher_for_depths
from mtp_train.teacher import backbone_stats, positions_ahead, teacher_log_probs


def test_backbone_stats_match_log_softmax_including_minus_inf_logits(monkeypatch):
    import mtp_train.teacher as teacher

    monkeypatch.setattr(teacher, "_CHUNK_ELEMS", 7 * 11)  # several chunks, one of them partial
    torch.manual_seed(0)
    x = torch.randn(3, 5, 11) * 3
    x[0, 0, :4] = float("-inf")  # zero-probability tokens add nothing to the entropy
    st = backbone_stats(x)
    logp = torch.log_softmax(x.double(), -1)
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    torch.testing.assert_close(st["lse"].double(), torch.logsumexp(x.double(), -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st["entropy"].double(), ent, rtol=1e-4, atol=1e-5)
    assert torch.equal(st["top"], x.argmax(-1))
    assert st["lse"].shape == (3, 5) and torch.isfinite(st["entropy"]).all()


def _setup(k=3):
    torch.manual_seed(1)
    B, T, d, V = 2, 9, 4, 13
    hidden = torch.randn(B, T, d)
    weight = torch.randn(V, d)
    logits = hidden @ weight.T  # (B, T, V)
    rows = torch.rand(B, T) > 0.4
    rows[:, -1] = True  # a row whose depths all run past the end
    return hidden, weight, logits, rows, k


def test_teacher_log_probs_equal_the_shifted_log_softmax_at_every_valid_depth():
    hidden, weight, logits, rows, k = _setup()
    lse = torch.logsumexp(logits, -1)
    ref = teacher_for_depths(torch.log_softmax(logits, -1), k)[rows]  # (N, k, V) slow reference
    got = teacher_log_probs(hidden, lse, rows, k, weight)
    given = teacher_log_probs(hidden, lse, rows, k, weight, logits=logits)
    b, pos = positions_ahead(rows, k)
    T = rows.shape[1]
    t = rows.nonzero()[:, 1]
    inside = (t[:, None] + torch.arange(1, k + 1)) < T  # (N, k) depths whose teacher exists
    torch.testing.assert_close(got[inside], ref[inside], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(given[inside], ref[inside], rtol=1e-5, atol=1e-5)
    assert pos.max() == T - 1 and b.shape == (len(t), 1)


def test_teacher_on_a_draft_vocabulary_is_the_full_distribution_restricted():
    hidden, weight, logits, rows, k = _setup()
    lse = torch.logsumexp(logits, -1)
    draft = torch.tensor([0, 3, 4, 10])
    full = teacher_log_probs(hidden, lse, rows, k, weight)
    sub = teacher_log_probs(hidden, lse, rows, k, weight[draft])
    torch.testing.assert_close(sub, full[..., draft], rtol=1e-5, atol=1e-5)
    assert (sub.exp().sum(-1) < 1).all()  # not renormalised: the mass outside stays missing
