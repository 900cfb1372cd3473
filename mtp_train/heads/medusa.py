"""Medusa-style parallel draft heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
Framework with Multiple Decoding Heads").

Head j (1..k) reads the backbone's final hidden state h_t and drafts token t+1+j (the backbone makes
t+1 itself). Each head is `num_layers` residual blocks x + SiLU(W x + b) with W and b zero-initialised,
so an untrained head returns h_t unchanged and starts as the backbone's own next-token head. The LM
head is the backbone's (shared, frozen, passed in at call time so it never enters a checkpoint) or a
trainable copy per depth.
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.heads.base import DraftHeads


class ResBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(DraftHeads):
    def __init__(self, hidden_size: int, vocab_size: int, k: int, num_layers: int = 1,
                 lm_head_weight: torch.Tensor | None = None, draft_ids: torch.Tensor | None = None):
        """`lm_head_weight` (V, d): given = each depth gets a trainable copy (of the draft vocabulary's
        rows when `draft_ids` is given); None = the shared head."""
        super().__init__()
        self.k, self.hidden_size = k, hidden_size
        self._init_draft(vocab_size, draft_ids)
        # a comprehension builds k distinct modules; `[ResBlock(d)] * k` would tie them
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(k))
        self.lm_heads = None
        if lm_head_weight is not None:
            rows = lm_head_weight if self.draft_ids is None else lm_head_weight[self.draft_ids]
            self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, len(rows), bias=False) for _ in range(k))
            with torch.no_grad():
                for head in self.lm_heads:
                    head.weight.copy_(rows)
        self.per_depth_lm = self.lm_heads is not None

    @classmethod
    def from_config(cls, cfg, backbone, draft_ids=None) -> MedusaHeads:
        copy = backbone.lm_head.weight.detach() if cfg.lm_head == "copy" else None
        return cls(backbone.hidden_size, backbone.vocab_size, cfg.k, cfg.num_layers, copy, draft_ids=draft_ids)

    def lm_weight(self, lm_head: nn.Module, depth: int | None = None) -> torch.Tensor:
        if self.lm_heads is None:
            return self.draft_weight(lm_head)
        if depth is None:
            raise ValueError("these Medusa heads have one LM head per depth; name the depth")
        return self.lm_heads[depth - 1].weight

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                embed: nn.Module | None = None, attention_mask: torch.Tensor | None = None, aux=None):
        """hidden (B, T, d) -> per-depth hidden states (B, T, k, d). Token inputs are unused."""
        return torch.stack([blk(hidden) for blk in self.blocks], dim=2)  # (B, T, k, d)

    def project(self, head_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """(B, T, k, d) -> logits (B, T, k, |D|) with the shared head or the per-depth copies."""
        if self.lm_heads is None:
            return super().project(head_hidden, lm_head)
        return torch.stack([h(head_hidden[..., j, :]) for j, h in enumerate(self.lm_heads)], dim=-2)
