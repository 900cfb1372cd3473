"""The decoder's drafter for Medusa heads (heads/medusa.py)."""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.decoding.matmul import MatmulPlan
from mtp_train.trees import DraftTree


class MedusaDrafter:
    """Parallel heads: every depth reads the backbone's h_p, whatever the drafts above it, so one
    matmul per step gives every depth's candidates."""

    def __init__(self, heads, lm_head: nn.Module, embed: nn.Module, mm: MatmulPlan):
        self.heads, self.k, self.mm = heads, heads.k, mm  # token inputs are unused
        self.dtype = next(heads.parameters()).dtype
        # one LM head for every depth (one matmul), or each depth's own
        self.weight = (None if heads.per_depth_lm else
                       heads.lm_weight(lm_head).detach().to(self.dtype).contiguous())  # (|D|, d)
        self.depth_weights = ([heads.lm_weight(lm_head, j).detach() for j in range(1, self.k + 1)]
                              if heads.per_depth_lm else None)
        self.to_tokens = heads.to_tokens

    def reset(self) -> None:
        pass

    def begin(self, tokens: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> None:
        self._h, self._lp = hidden[-1].to(self.dtype), None

    def _all(self) -> torch.Tensor:
        if self._lp is None:
            hh = torch.stack([blk(self._h) for blk in self.heads.blocks])  # (k, d)
            if self.weight is not None:
                logits = self.mm.mm(hh, self.weight)  # (k, |D|)
            else:
                logits = torch.stack([self.mm.mm(hh[j], w) for j, w in enumerate(self.depth_weights)])
            self._lp = torch.log_softmax(logits.float(), -1)
        return self._lp

    def level(self, j: int, expand: list[int], tree: DraftTree) -> torch.Tensor:
        return self._all()[j - 1].expand(len(expand), -1)

