"""The learning-rate schedule over a length that may change while training runs.

`train.lr_schedule` (cosine to train.min_lr_ratio, constant, or warmup-stable-decay) after
train.warmup_steps of linear warm-up, as transformers' schedules define them (a test holds ours to
theirs at a fixed length). Ours keeps the length in an attribute, `LrShape.total`: when training
runs to a time budget (train.time_budget_min, `mtp_train.lit.budget`), the number of steps is
planned from the measured step time and revised as training goes, and the schedule stretches or
shrinks to end where training ends instead of being cut off part-way. The attributes are plain
numbers, so LambdaLR's state_dict carries them through a checkpoint and a resumed run continues the
same curve.
"""

from __future__ import annotations

import math

import torch

from mtp_train.config import TrainConfig


class LrShape:
    """The multiplier of train.lr at optimizer step `step` of `total`."""

    def __init__(self, cfg: TrainConfig, total: int):
        self.kind = cfg.lr_schedule
        self.warmup = cfg.warmup_steps
        self.min_ratio = cfg.min_lr_ratio
        self.decay_fraction = cfg.decay_fraction
        self.total = max(1, int(total))

    def __call__(self, step: int) -> float:
        total = self.total
        warm = min(self.warmup, total)
        if self.kind == "wsd":
            decay = max(1, min(total - warm, round(self.decay_fraction * total)))
            if step < warm:  # transformers' wsd warms up from min_lr_ratio, not from 0
                return max(0.0, step / max(1, warm) * (1 - self.min_ratio) + self.min_ratio)
            stable = total - warm - decay
            if step < warm + stable:
                return 1.0
            if step < total:
                return max(0.0, self._cosine((step - warm - stable) / max(1, decay)))
            return self.min_ratio
        if step < warm:
            return step / max(1, warm)
        if self.kind == "constant":
            return 1.0
        return max(0.0, self._cosine((step - warm) / max(1, total - warm)))

    def _cosine(self, progress: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - self.min_ratio) + self.min_ratio


def lr_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """train.lr_schedule over `total` optimizer steps; `.lr_lambdas[0]` is the LrShape whose
    `total` a time budget revises."""
    return torch.optim.lr_scheduler.LambdaLR(opt, LrShape(cfg, total))
