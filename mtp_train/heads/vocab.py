"""Draft vocabulary: heads that score only the most frequent tokens (EAGLE-3's d2t, vLLM's truncated
vocabulary). Every depth ends in the LM head, d x V; restricted to |D| of the V rows, drafting and
training both shrink by V / |D| where the LM head dominates (SmolLM2: V = 49,152, d = 576).

A head with a draft vocabulary holds `draft_ids` (|D|,), sorted token ids, as a buffer: it is saved
with the heads (they are meaningless without it) but never trains. Logits index into it; `to_tokens`
maps a draft index back to a token id and `to_draft` a token id to its index (-1 when outside D).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def select_draft_vocab(counts: np.ndarray, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent token ids by `counts` (V,) (ties: lower id first), plus `always`
    (special tokens such as end-of-turn, which must be draftable), sorted ascending."""
    order = np.argsort(-np.asarray(counts), kind="stable")
    keep = [int(t) for t in always if 0 <= t < len(counts)]
    chosen = set(keep)
    for t in order:
        if len(chosen) >= max(size, len(keep)):
            break
        chosen.add(int(t))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def check_draft_ids(ids: torch.Tensor, vocab_size: int, where: str) -> None:
    """Refuse a saved draft vocabulary that would index wrongly: not a 1-D integer tensor, ids outside
    [0, vocab_size), or not strictly ascending (duplicates, or not the sorted ids written here)."""
    from mtp_train.errors import MtpError

    if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool or len(ids) < 2:
        raise MtpError(f"{where}: draft_ids must be a 1-D integer tensor of at least 2 token ids, got "
                       f"{str(ids.dtype).removeprefix('torch.')} of shape {list(ids.shape)}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise MtpError(f"{where}: draft_ids holds token id {lo if lo < 0 else hi}, outside this backbone's "
                       f"vocabulary [0, {vocab_size})")
    if not bool((ids[1:] > ids[:-1]).all()):
        at = int((ids[1:] <= ids[:-1]).nonzero()[0, 0]) + 1
        raise MtpError(f"{where}: draft_ids is not strictly ascending at index {at} ({int(ids[at - 1])}, "
                       f"{int(ids[at])}): duplicated or unsorted ids")


def label_token_counts(rows, vocab_size: int) -> np.ndarray:
    """Counts (V,) of the labelled (assistant) tokens of a dataset with input_ids and labels."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in rows.iter(batch_size=1024):
        for labels in batch["labels"]:
            lab = np.asarray(labels)
            counts += np.bincount(lab[lab >= 0], minlength=vocab_size)[:vocab_size]
    return counts


class DraftVocab(nn.Module):
    """Mixin for head families: the optional draft vocabulary and the projection onto it."""

    def _apply(self, fn, recurse=True):
        """Casting the heads (bf16 drafting, DeepSpeed's bf16) keeps rotary frequencies (`inv_freq`
        buffers) in float32: a bf16 copy is off by up to 0.2%, an error that grows with the
        position (the backbone keeps its own in float32 too)."""
        kept = {n: b for n, b in self.named_buffers() if n.endswith("inv_freq")}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            now = self.get_buffer(name)
            if now.dtype != old.dtype:
                owner, _, leaf = name.rpartition(".")
                setattr(self.get_submodule(owner), leaf, old.to(now.device))
        return self

    def _init_draft(self, vocab_size: int, draft_ids: torch.Tensor | None) -> None:
        self.vocab_size = vocab_size
        if draft_ids is not None:
            draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
            if draft_ids.dim() != 1 or not 0 < len(draft_ids) <= vocab_size:
                raise ValueError(f"draft_ids must be 1-D with 1..{vocab_size} entries, got "
                                 f"{tuple(draft_ids.shape)}")
            if (draft_ids < 0).any() or (draft_ids >= vocab_size).any() or (draft_ids.diff() <= 0).any():
                raise ValueError("draft_ids must be sorted, distinct token ids below the vocabulary size")
        self.register_buffer("draft_ids", draft_ids)

    @property
    def draft_size(self) -> int:
        return self.vocab_size if self.draft_ids is None else len(self.draft_ids)

    def draft_weight(self, lm_head: nn.Module) -> torch.Tensor:
        """The LM head's rows this head scores: (|D|, d), or the whole (V, d) weight."""
        w = lm_head.weight
        return w if self.draft_ids is None else w.index_select(0, self.draft_ids)

    def to_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft indices -> token ids (identity without a draft vocabulary)."""
        return idx if self.draft_ids is None else self.draft_ids[idx]

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> draft indices, -1 for tokens outside the draft vocabulary."""
        if self.draft_ids is None:
            return tokens
        pos = torch.searchsorted(self.draft_ids, tokens.clamp(min=0))
        pos = pos.clamp(max=len(self.draft_ids) - 1)
        return torch.where(self.draft_ids[pos] == tokens, pos, torch.full_like(pos, -1))
