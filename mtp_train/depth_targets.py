"""Where each draft depth's target lives: the one place that knows the MTP index offsets.

Backbone-as-Architect: the backbone makes token t+1 from position t; head j (1..k) at position t
drafts token t+1+j. So for depth j:
    target token   x_{t+1+j}                       (the data token)
    teacher        the backbone's logits at t+j    (its distribution over x_{t+1+j})
A target counts when it lies inside the sequence, is a real (unpadded) token and carries a label
(assistant tokens only, see data/template.py).
"""

from __future__ import annotations

import torch

from mtp_train.choices import IGNORE_INDEX

IGNORE = IGNORE_INDEX


def shift_for_depths(x: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """x (B, T, ...) -> (B, T, k, ...) with out[:, t, j-1] = x[:, t + j + offset], zeros past the end."""
    B, T = x.shape[:2]
    out = x.new_zeros((B, T, k, *x.shape[2:]))
    for j in range(1, k + 1):
        s = j + offset
        if s < T:
            out[:, : T - s, j - 1] = x[:, s:]
    return out


def depth_targets(input_ids: torch.Tensor, labels: torch.Tensor, k: int,
                  attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and labels -> targets (B, T, k) long and valid (B, T, k) bool for x_{t+1+j}."""
    keep = labels != IGNORE  # (B, T)
    if attention_mask is not None:
        keep = keep & attention_mask.bool()
    targets = shift_for_depths(input_ids, k, offset=1)  # (B, T, k)
    valid = shift_for_depths(keep, k, offset=1)  # (B, T, k), False past the end
    if attention_mask is not None:
        valid = valid & attention_mask.bool()[..., None]  # the drafting position must be real too
    return targets, valid


def teacher_for_depths(backbone_logits: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T, V) -> (B, T, k, V): the backbone's distribution over each depth's target."""
    return shift_for_depths(backbone_logits, k, offset=0)
