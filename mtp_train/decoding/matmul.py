"""Matmul layout for the decoder's small-batch linears, chosen by timing it on this machine
(`costs.measure_matmuls`): x @ W^T as `F.linear` or as `W @ x^T`, per weight shape and row count."""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class MatmulPlan:
    """For each weight shape and dtype the decoder multiplies, and each row-count bucket, whether to
    compute x @ W^T as `F.linear` or as `W @ x^T`. Which is faster for 2-8 rows differs between CPUs
    and BLAS builds, in both directions (docs/decoding.md), so `costs.measure_matmuls` decides by
    timing whole forwards on the machine at hand; an unknown shape uses F.linear."""

    def __init__(self, choices: dict | None = None):
        self.choices: dict[tuple, list[bool]] = choices or {}  # key -> per bucket: use W @ x^T

    @staticmethod
    def key(weight: torch.Tensor) -> tuple:
        return (tuple(weight.shape), str(weight.dtype), weight.device.type)

    def mm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., d) @ weight (n, d)^T (+ bias) in the layout measured faster for this many rows."""
        rows = x.numel() // max(1, x.shape[-1])
        choice = self.choices.get(self.key(weight))
        if choice is None or rows > ROW_BUCKETS[-1] or x.requires_grad:
            return F.linear(x, weight, bias)
        bucket = next(i for i, b in enumerate(ROW_BUCKETS) if b >= rows)
        if not choice[bucket]:
            return F.linear(x, weight, bias)
        y = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def describe(self) -> str:
        """Per row bucket, L (F.linear) or T (W @ x^T); per weight shape where they differ."""
        layouts = {"".join("T" if t else "L" for t in v) for v in self.choices.values()}
        if len(layouts) <= 1:
            return next(iter(layouts), "")
        return str({f"{k[0][0]}x{k[0][1]}": "".join("T" if t else "L" for t in v) for k, v in self.choices.items()})


def _routed_linear(self, x: torch.Tensor) -> torch.Tensor:
    return self._mm_plan.mm(x, self.weight, self.bias)


@contextlib.contextmanager
def routed_linears(plan: MatmulPlan, *modules: nn.Module):
    """Within the block, every nn.Linear under `modules` multiplies through `plan`."""
    patched = []
    for m in modules:
        for lin in (x for x in m.modules() if type(x) is nn.Linear):
            lin._mm_plan = plan
            lin.forward = types.MethodType(_routed_linear, lin)
            patched.append(lin)
    try:
        yield
    finally:
        for lin in patched:
            del lin.forward  # back to the class's forward
            del lin._mm_plan

