"""MTP index offsets against a loop reference."""

import torch

from mtp_train.depth_targets import IGNORE, depth_targets, shift_for_depths, teacher_for_depths


def test_depth_targets_match_a_loop_reference():
    g = torch.Generator().manual_seed(0)
    B, T, k = 2, 9, 3
    ids = torch.randint(0, 50, (B, T), generator=g)
    labels = torch.where(torch.rand(B, T, generator=g) < 0.3, torch.full_like(ids, IGNORE), ids)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 7:] = 0  # right padding
    targets, valid = depth_targets(ids, labels, k, attn)
    for b in range(B):
        for t in range(T):
            for j in range(1, k + 1):
                s = t + 1 + j
                ok = s < T and labels[b, s] != IGNORE and attn[b, s] == 1 and attn[b, t] == 1
                assert valid[b, t, j - 1].item() == ok, (b, t, j)
                if ok:
                    assert targets[b, t, j - 1] == ids[b, s]


def test_teacher_is_the_backbone_at_t_plus_j():
    x = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    out = teacher_for_depths(x, 2)
    assert out.shape == (2, 6, 2, 4)
    assert torch.equal(out[:, 1, 0], x[:, 2]) and torch.equal(out[:, 1, 1], x[:, 3])
    assert torch.all(out[:, 5, 0] == 0) and torch.all(out[:, 4, 1] == 0)
    assert torch.equal(shift_for_depths(x, 1, offset=1)[:, 0, 0], x[:, 2])
