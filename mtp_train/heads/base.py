"""What every head family is: the interface training, decoding and export rely on.

    forward(hidden (B, T, d), input_ids (B, T), embed, attention_mask, aux) -> (B, T, k, d)
    project(head_hidden (B, T, k, d), lm_head) -> logits (B, T, k, |D|)
    lm_weight(lm_head, depth)  the draft LM head's weight (|D|, d) for a depth
    aux_layers                 backbone layers whose inputs the heads read besides the final
                               state (empty for families that read only the final state)
    to_tokens / to_draft       draft index <-> token id (heads.vocab.DraftVocab)

The backbone's embedding and LM head are passed in at call time, never stored, so a heads
state_dict holds only what trains (plus the draft vocabulary's token ids, when there is one). Each
family also says how it is built from `heads.*` (`from_config`); the rest of what differs by family
is its record in heads/registry.py.
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.heads.vocab import DraftVocab


class DraftHeads(DraftVocab):
    k: int
    hidden_size: int
    aux_layers: tuple[int, ...] | list[int] = ()
    per_depth_lm: bool = False  # True when each depth has its own LM head (lm_head=copy on Medusa)

    @classmethod
    def from_config(cls, cfg, backbone, draft_ids: torch.Tensor | None = None) -> DraftHeads:
        """Heads for `backbone` (a backbone.Backbone) from a HeadsConfig."""
        raise NotImplementedError

    @classmethod
    def aux_layers_for(cls, cfg, backbone_config) -> list[int]:
        """The backbone layers heads built from `cfg` will read besides the final state."""
        return []

    def lm_weight(self, lm_head: nn.Module, depth: int | None = None) -> torch.Tensor:
        """The LM head these heads score with at `depth` (1..k; None when one serves every depth):
        the backbone's rows for the draft vocabulary, (|D|, d)."""
        return self.draft_weight(lm_head)

    def project(self, head_hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """(B, T, k, d) -> logits (B, T, k, |D|) with one LM head for every depth."""
        return head_hidden @ self.lm_weight(lm_head).T
