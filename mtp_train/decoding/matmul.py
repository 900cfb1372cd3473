"""Matmul layout for the decoder's small-batch linears, chosen by timing it on this machine
(`costs.measure_matmuls`): x @ W^T as `F.linear`, as `W @ x^T`, or through a copy of W that oneDNN
has packed once for small batches, per weight shape and row count."""

from __future__ import annotations

import contextlib
import functools
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

# every row count a step commonly has (1-8: a chain, a small tree, the drafter's levels) is timed on
# its own: one layout can be the fastest at 4 rows and the slowest at 3 (AVX2 EPYC: W @ x^T read 1.37
# one-token forwards at 3 rows, 1.11 at 4)
ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64, 128)
# the layouts, as one letter each: F.linear, W @ x^T, oneDNN's linear on a packed copy of W
LAYOUTS = ("L", "T", "P")
# the row count oneDNN packs the weights for. On a 2-core AVX2 EPYC (family 25 model 1) packed for
# 2 to 16 rows, all 30 SmolLM2 layers' linears plus the LM head took 33-34 ms for 1 row and 40 ms
# for 4 against F.linear's 45 and 86; packed for 1 row, 4 rows took 66 (docs/decoding.md)
PACK_ROWS = 4


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack this weight here (a CPU tensor; bf16 needs avx512bw/avx_ne_convert)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight[:1].detach().contiguous(), PACK_ROWS)
    except RuntimeError:
        return False
    return True


class MatmulPlan:
    """For each weight shape and dtype the decoder multiplies, and each row-count bucket, the layout
    of x @ W^T: "L" `F.linear`, "T" `W @ x^T`, or "P" oneDNN's linear on a packed copy of W (made
    on first use and kept while W is unchanged; a weight oneDNN cannot pack uses F.linear). Which is
    faster for 2-16 rows differs between CPUs and BLAS builds, in every direction (docs/decoding.md),
    so `costs.measure_matmuls` decides by timing whole forwards on the machine at hand; an unknown
    shape uses F.linear."""

    def __init__(self, choices: dict | None = None):
        self.choices: dict[tuple, list[str]] = choices or {}  # key -> per bucket: a letter of LAYOUTS
        # id(weight) -> (a weak reference to it, its version when packed, the packed copy or None where
        # it cannot be packed); an entry leaves with its weight (tensors compare by value, so no WeakKeyDictionary)
        self._packed: dict[int, tuple] = {}

    @staticmethod
    def key(weight: torch.Tensor) -> tuple:
        return (tuple(weight.shape), str(weight.dtype), weight.device.type)

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """oneDNN's packed copy of `weight` (None where it cannot be packed), remade after an in-place change."""
        got = self._packed.get(id(weight))
        if got is None or got[0]() is not weight or got[1] != _version(weight):
            packed = None
            if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
                try:  # packed once, not tried on a slice first (can_pack's probe)
                    with torch.no_grad():
                        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)
                except RuntimeError:  # a dtype this CPU cannot pack: F.linear
                    packed = None
            got = self._keep(weight, _version(weight), packed)
        return got[2]

    def adopt_packed(self, other: MatmulPlan) -> None:
        """Use the packed copies `other` has made (no weight is packed twice)."""
        for ref, version, packed in list(other._packed.values()):
            if (weight := ref()) is not None:
                self._keep(weight, version, packed)

    def _keep(self, weight: torch.Tensor, version: int, packed: torch.Tensor | None) -> tuple:
        table, key = self._packed, id(weight)
        table[key] = (weakref.ref(weight, lambda _: table.pop(key, None)), version, packed)
        return table[key]

    def mm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., d) @ weight (n, d)^T (+ bias) in the layout measured faster for this many rows."""
        rows = x.numel() // max(1, x.shape[-1])
        choice = self.choices.get(self.key(weight))
        if choice is None or rows > ROW_BUCKETS[-1] or x.requires_grad:
            return F.linear(x, weight, bias)
        return self.apply(by_rows(choice)[rows], x, weight, bias, rows)

    def apply(self, layout: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              rows: int) -> torch.Tensor:
        """x (`rows` rows of d) @ weight^T (+ bias) in `layout`."""
        if layout == "P" and (w := self.packed(weight)) is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]).contiguous(), w, bias, "none", [], "")
            return y.reshape(*x.shape[:-1], weight.shape[0])
        if layout != "T":
            return F.linear(x, weight, bias)
        y = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def describe(self) -> str:
        """Per row bucket, L (F.linear), T (W @ x^T) or P (packed); per weight shape where they differ."""
        layouts = {"".join(v) for v in self.choices.values()}
        if len(layouts) <= 1:
            return next(iter(layouts), "")
        return str({f"{k[0][0]}x{k[0][1]}": "".join(v) for k, v in self.choices.items()})


def _version(weight: torch.Tensor) -> int:
    """The tensor's in-place change counter (an inference tensor keeps none: changed only inside
    inference mode, where the decoder never writes its weights)."""
    return -1 if weight.is_inference() else weight._version


@functools.lru_cache(maxsize=64)
def _by_rows(choice: tuple[str, ...]) -> tuple[str, ...]:
    return ("L", *(choice[next(i for i, b in enumerate(ROW_BUCKETS) if b >= r)] for r in range(1, ROW_BUCKETS[-1] + 1)))


def by_rows(choice) -> tuple[str, ...]:
    """A per-bucket choice as a table indexed by the row count itself (0 .. ROW_BUCKETS[-1])."""
    return _by_rows(tuple(choice))


def _routed_linear(self, x: torch.Tensor) -> torch.Tensor:
    # the decoder's hot path (every linear of every forward): the layout is looked up by row count in
    # a table made when the block was entered; Python here costs the decoder what HF generate does not pay
    rows = x.numel() // x.shape[-1]
    if rows >= len(self._mm_rows) or x.requires_grad or (layout := self._mm_rows[rows]) == "L":
        return F.linear(x, self.weight, self.bias)
    return self._mm_plan.apply(layout, x, self.weight, self.bias, rows)


@contextlib.contextmanager
def routed_linears(plan: MatmulPlan, *modules: nn.Module):
    """Within the block, every nn.Linear under `modules` whose shape the plan knows multiplies through
    it (the others keep F.linear)."""
    patched = []
    for m in modules:
        for lin in (x for x in m.modules() if type(x) is nn.Linear):
            choice = plan.choices.get(plan.key(lin.weight))
            if choice is None:
                continue
            lin._mm_plan, lin._mm_rows = plan, by_rows(choice)
            lin.forward = types.MethodType(_routed_linear, lin)
            patched.append(lin)
    try:
        yield
    finally:
        for lin in patched:
            del lin.forward  # back to the class's forward
            del lin._mm_plan, lin._mm_rows

