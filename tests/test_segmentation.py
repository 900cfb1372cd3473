"""AdaMTP segmentation (Cui et al. 2026): entropy, boundary rules, group ids, the target mask and its
summaries, checked on hand-made sequences and against slow loop references over b, t and j."""

from __future__ import annotations

import math

import pytest
import torch

from mtp_train.segmentation import (
    adamtp_mask,
    boundaries,
    entropy,
    group_ids,
    make_adamtp_mask,
    masked_fraction,
    segment_depth,
)


def _row(values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)  # (1, T)


def _bools(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


def _in_range(B: int, T: int, k: int) -> torch.Tensor:
    """(B, T, k) bool: head j at t has a target, t+1+j < T."""
    t = torch.arange(T).view(1, T, 1)
    j = torch.arange(1, k + 1).view(1, 1, k)
    return (t + 1 + j < T).expand(B, T, k).clone()


# ---------------------------------------------------------------------------------------------------
# slow references


def _entropy_ref(logits: torch.Tensor) -> torch.Tensor:
    B, T, V = logits.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            xs = [float(x) for x in logits[b, t]]
            mx = max(xs)
            z = sum(math.exp(x - mx) for x in xs)
            h = 0.0
            for x in xs:
                p = math.exp(x - mx) / z
                if p > 0:
                    h -= p * math.log(p)
            out[b, t] = h
    return out


def _diff_ref(H: torch.Tensor, theta: float, valid: torch.Tensor) -> torch.Tensor:
    B, T = H.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for t in range(1, T):
            if valid[b, t] and valid[b, t - 1]:
                out[b, t] = float(H[b, t]) - float(H[b, t - 1]) > theta
    return out


def _zscore_ref(H: torch.Tensor, window: int, z: float, valid: torch.Tensor) -> torch.Tensor:
    B, T = H.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            if not valid[b, t]:
                continue
            prev = [float(H[b, s]) for s in range(max(0, t - window), t) if valid[b, s]]
            if len(prev) < 2:
                continue
            mean = sum(prev) / len(prev)
            std = math.sqrt(sum((x - mean) ** 2 for x in prev) / len(prev))
            out[b, t] = float(H[b, t]) - mean > max(z * std, 1e-6)
    return out


def _mask_ref(g: torch.Tensor, k: int) -> torch.Tensor:
    B, T = g.shape
    out = torch.zeros(B, T, k, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for j in range(1, k + 1):
                if t + 1 + j < T:
                    out[b, t, j - 1] = int(g[b, t + 1]) == int(g[b, t + 1 + j])
    return out


# ---------------------------------------------------------------------------------------------------
# entropy


def test_entropy_matches_loop_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 3  # (B, T, V)
    H = entropy(logits)
    assert H.shape == (2, 5) and H.dtype == torch.float32
    torch.testing.assert_close(H.double(), _entropy_ref(logits), atol=1e-5, rtol=1e-5)


def test_entropy_known_values():
    V = 49
    uniform = torch.zeros(1, 2, V)  # (1, 2, V)
    torch.testing.assert_close(entropy(uniform), torch.full((1, 2), math.log(V)))
    one_hot = torch.full((1, 3, V), float("-inf"))
    one_hot[0, :, 7] = 0.0  # p = 1 on one token, exact zeros elsewhere
    assert torch.equal(entropy(one_hot), torch.zeros(1, 3))
    peaked = torch.full((1, 1, V), -1e4)
    peaked[0, 0, 0] = 0.0
    assert entropy(peaked).abs().max() < 1e-6
    two = torch.full((1, 1, V), float("-inf"))
    two[0, 0, :2] = 0.0  # uniform over two tokens among -inf logits
    torch.testing.assert_close(entropy(two), torch.full((1, 1), math.log(2)))


def test_entropy_chunked_low_precision_and_grad():
    torch.manual_seed(1)
    logits = torch.randn(3, 7, 13)  # (B, T, V)
    full = entropy(logits)
    torch.testing.assert_close(entropy(logits, chunk_rows=1), full)
    torch.testing.assert_close(entropy(logits, chunk_rows=4), full)
    half = entropy(logits.bfloat16())
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, entropy(logits.bfloat16().float()))
    x = logits.clone().requires_grad_(True)
    entropy(x, chunk_rows=5).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_entropy_rejects_wrong_rank():
    with pytest.raises(ValueError, match="B, T, V"):
        entropy(torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------------
# boundary rules


def test_diff_rule_hand_made():
    H = _row([1, 1, 3, 3, 0.5, 2.8])
    b = boundaries(H, rule="diff", theta=1.0)
    assert b.dtype == torch.bool
    assert b[0].nonzero().flatten().tolist() == [2, 5]


def test_diff_rule_is_strict_and_never_at_zero():
    assert not boundaries(_row([0.0, 1.0]), theta=1.0).any()  # a jump of exactly theta
    assert boundaries(_row([0.0, 1.5]), theta=1.0)[0].tolist() == [False, True]
    assert not boundaries(_row([9.0, 0.0, 0.0]), theta=-100.0)[0, 0]  # t = 0 has no predecessor


def test_diff_rule_matches_loop_reference():
    torch.manual_seed(2)
    H = torch.rand(3, 20) * 4  # (B, T)
    valid = torch.rand(3, 20) > 0.2
    for v in (None, valid):
        ref = _diff_ref(H, 0.7, torch.ones_like(valid) if v is None else v)
        assert torch.equal(boundaries(H, "diff", theta=0.7, valid=v), ref)


def test_zscore_rule_single_spike():
    H = _row([1.0, 1.2, 0.8, 1.0, 1.0, 5.0, 1.0, 1.1])
    b = boundaries(H, rule="zscore", window=4, z_threshold=2.0)
    assert b[0].nonzero().flatten().tolist() == [5]
    # The same spike fails a threshold above its z-score (4 / sqrt(0.02) ~ 28.3).
    assert not boundaries(H, rule="zscore", window=4, z_threshold=30.0).any()


def test_zscore_rule_needs_two_previous_values():
    H = _row([0.0, 10.0, 10.0])
    # t=1 has one previous value, so even z = 0 does not cut there; t=2 sees [0, 10], mean 5, std 5.
    assert boundaries(H, rule="zscore", window=4, z_threshold=0.0)[0].tolist() == [
        False, False, True]
    assert not boundaries(H, rule="zscore", window=4, z_threshold=1.0).any()  # 10 - 5 > 1 * 5 fails


def test_zscore_rule_flat_window():
    assert boundaries(_row([1, 1, 1, 1.5]), rule="zscore", window=3)[0].tolist() == [
        False, False, False, True]
    assert not boundaries(_row([1, 1, 1, 1]), rule="zscore", window=3).any()


def test_zscore_window_covers_only_previous_positions():
    H = _row([100.0, 1.0, 1.0, 1.0, 2.0])
    assert boundaries(H, rule="zscore", window=3)[0, 4]  # sees [1, 1, 1]: flat, 2 is above
    assert not boundaries(H, rule="zscore", window=4)[0, 4]  # the 100 inflates mean and std


def test_zscore_rule_matches_loop_reference():
    torch.manual_seed(3)
    H = torch.rand(3, 40) * 2  # (B, T)
    H[:, ::7] += 3.0  # occasional spikes
    valid = torch.rand(3, 40) > 0.15
    for v in (None, valid):
        for window, z in ((4, 1.0), (16, 2.0), (2, 0.0)):
            ref = _zscore_ref(H, window, z, torch.ones_like(valid) if v is None else v)
            got = boundaries(H, "zscore", window=window, z_threshold=z, valid=v)
            assert torch.equal(got, ref), (window, z, v is None)


def test_boundaries_rejects_bad_arguments():
    H = _row([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="bogus"):
        boundaries(H, rule="bogus")
    with pytest.raises(ValueError, match="window"):
        boundaries(H, rule="zscore", window=1)
    with pytest.raises(ValueError, match="shape"):
        boundaries(H, valid=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        boundaries(H, valid=torch.ones(1, 3))


# ---------------------------------------------------------------------------------------------------
# padding


@pytest.mark.parametrize("rule", ["diff", "zscore"])
def test_padding_is_never_a_boundary_and_stays_out_of_stats(rule):
    real = [1.0, 1.1, 0.9, 1.0, 4.0, 4.1, 0.2, 3.5]
    pad = 3
    H = _row([50.0, -20.0, 80.0] + real + [0.0, 90.0])  # garbage entropies at padding positions
    valid = _bools([[False] * pad + [True] * len(real) + [False, False]])
    kw = dict(rule=rule, theta=1.0, window=4, z_threshold=1.5)
    got = boundaries(H, valid=valid, **kw)
    expected = boundaries(_row(real), **kw)  # the same sentence without padding
    assert expected.any()  # the check below is not vacuous
    assert not got[~valid].any()
    assert torch.equal(got[0, pad:pad + len(real)], expected[0])


def test_padding_with_non_finite_entropy_is_ignored_by_zscore():
    H = _row([float("inf"), 1.0, 1.0, 1.0, 2.0])
    valid = _bools([[False, True, True, True, True]])
    assert boundaries(H, "zscore", window=4, valid=valid)[0].tolist() == [
        False, False, False, False, True]


# ---------------------------------------------------------------------------------------------------
# group ids and the mask


def test_group_ids():
    b = _bools([[False, False, True, False, False, True], [True, True, False, False, False, False]])
    assert group_ids(b).tolist() == [[0, 0, 1, 1, 1, 2], [1, 2, 2, 2, 2, 2]]
    assert group_ids(b).dtype == torch.long
    with pytest.raises(TypeError, match="bool"):
        group_ids(b.float())


def test_adamtp_mask_hand_made():
    g = torch.tensor([[0, 0, 1, 1, 1, 2]])  # boundaries before t=2 and t=5
    m = adamtp_mask(g, k=2)
    assert m.shape == (1, 6, 2) and m.dtype == torch.bool
    F_, T_ = False, True
    assert m[0].tolist() == [
        [F_, F_],  # t=0: backbone token at 1 (g 0); targets 2, 3 are in group 1
        [T_, T_],  # t=1: token at 2 (g 1); targets 3, 4 in group 1
        [T_, F_],  # t=2: token at 3; target 4 in group 1, target 5 in group 2
        [F_, F_],  # t=3: target 5 in group 2; target 6 out of range
        [F_, F_],  # t=4: out of range
        [F_, F_],  # t=5: out of range
    ]
    assert torch.equal(m, _mask_ref(g, 2))


def test_adamtp_mask_matches_loop_reference_on_random_boundaries():
    torch.manual_seed(4)
    for B, T, k in ((3, 17, 4), (2, 5, 6), (1, 2, 1), (2, 1, 3)):
        g = group_ids(torch.rand(B, T) < 0.3)
        m = adamtp_mask(g, k)
        assert torch.equal(m, _mask_ref(g, k))
        assert not (m[..., 1:] & ~m[..., :-1]).any()  # monotone in j
        assert torch.equal(segment_depth(m), m.sum(dim=-1))


def test_adamtp_mask_without_boundaries_is_all_in_range_targets():
    g = group_ids(torch.zeros(2, 6, dtype=torch.bool))
    m = adamtp_mask(g, k=3)
    assert torch.equal(m, _in_range(2, 6, 3))
    assert m[0].tolist()[:4] == [[True] * 3, [True] * 3, [True, True, False], [True, False, False]]


def test_adamtp_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k must"):
        adamtp_mask(torch.zeros(1, 4, dtype=torch.long), 0)
    with pytest.raises(TypeError, match="integer"):
        adamtp_mask(torch.zeros(1, 4, dtype=torch.bool), 2)


# ---------------------------------------------------------------------------------------------------
# summaries


def test_segment_depth():
    m = adamtp_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]), k=2)
    assert segment_depth(m).tolist() == [[0, 2, 1, 0, 0, 0]]
    assert segment_depth(m).dtype == torch.long
    odd = _bools([[[False, True, False], [True, False, True], [False, False, False]]])
    assert segment_depth(odd).tolist() == [[2, 3, 0]]  # the deepest kept head, even if not monotone


def test_masked_fraction():
    m = adamtp_mask(torch.tensor([[0, 0, 1, 1, 1, 2]]), k=2)
    frac = masked_fraction(m, _in_range(1, 6, 2))
    # depth 1: targets exist at t=0..3, kept at t=1, 2 -> 2/4 dropped
    # depth 2: targets exist at t=0..2, kept at t=1 -> 2/3 dropped
    torch.testing.assert_close(frac, torch.tensor([0.5, 2 / 3]))
    assert frac.dtype == torch.float32


def test_masked_fraction_pools_batch_and_handles_no_targets():
    m = _bools([[[True, False]], [[False, False]]])  # (2, 1, 2)
    valid = _bools([[[True, False]], [[True, False]]])
    assert masked_fraction(m, valid).tolist() == [0.5, 0.0]  # depth 2 has no valid target
    assert masked_fraction(m, torch.zeros_like(valid)).tolist() == [0.0, 0.0]
    none = adamtp_mask(group_ids(torch.zeros(1, 8, dtype=torch.bool)), 3)
    assert masked_fraction(none, _in_range(1, 8, 3)).tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------
# end to end


def _logits_with_entropies(support: list[list[int]], V: int = 64) -> torch.Tensor:
    """(B, T, V) logits uniform over the first n tokens, so H = log n exactly."""
    B, T = len(support), len(support[0])
    logits = torch.full((B, T, V), float("-inf"))
    for b in range(B):
        for t in range(T):
            logits[b, t, :support[b][t]] = 0.0
    return logits


def test_make_adamtp_mask_end_to_end():
    # log 2 = 0.69, log 8 = 2.08, log 64 = 4.16: jumps 1 -> 8 and 2 -> 64 exceed theta = 1.
    support = [[1, 1, 8, 8, 2, 64, 64, 1], [2, 2, 2, 2, 2, 2, 2, 2]]
    logits = _logits_with_entropies(support).requires_grad_(True)
    m = make_adamtp_mask(logits, k=3, rule="diff", theta=1.0)
    assert m.shape == (2, 8, 3) and m.dtype == torch.bool and not m.requires_grad
    b = boundaries(entropy(logits.detach()), rule="diff", theta=1.0)
    assert b[0].nonzero().flatten().tolist() == [2, 5] and not b[1].any()
    assert torch.equal(m, _mask_ref(group_ids(b), 3))
    assert torch.equal(m[1], _in_range(1, 8, 3)[0])  # flat entropy: plain MTP mask
    for rule in ("diff", "zscore"):
        kw = dict(rule=rule, theta=1.0, window=3, z_threshold=1.0)
        expected = adamtp_mask(group_ids(boundaries(entropy(logits.detach()), **kw)), 3)
        assert torch.equal(make_adamtp_mask(logits, 3, **kw), expected)


def test_make_adamtp_mask_passes_valid_tokens():
    support = [[1, 1, 1, 64, 64, 1, 1, 1]]
    logits = _logits_with_entropies(support)
    assert not make_adamtp_mask(logits, 2).all(dim=-1)[0, :3].all()  # the jump at t=3 masks
    valid = _bools([[True, True, True, False, False, False, False, False]])
    m = make_adamtp_mask(logits, 2, valid_tokens=valid)
    assert torch.equal(m, _in_range(1, 8, 2))  # padding never cuts
