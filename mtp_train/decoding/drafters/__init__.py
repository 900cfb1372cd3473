"""Drafters: what a family's heads propose under the last committed token, one module per family
(its heads/registry.py record names it).

A drafter has `k`, `to_tokens` (draft index -> token id), `reset()` before a prompt, `begin(tokens,
hidden, aux)` once per step (the committed tokens (N,), the backbone's states (N - 1, d) and, for
families that read them, its auxiliary layers' states (N - 1, n_aux * d)), and `level(j, expand,
tree)` -> log-probabilities (len(expand), |D|) of the depth-j candidates under each node of
`expand` (node indices of `tree`, -1 = the root). `drafting.draft_tree` builds a step's tree from it.
"""

from __future__ import annotations

from mtp_train.decoding.matmul import MatmulPlan
from mtp_train.heads.registry import FAMILIES


def family_of(heads) -> str:
    """The heads.type whose heads class `heads` is (a subclass counts as its family's)."""
    for fam in FAMILIES.values():
        if isinstance(heads, fam.heads_class()):
            return fam.name
    raise TypeError(f"{type(heads).__name__} is no registered head family's heads class "
                    f"(mtp_train/heads/registry.py)")


def make_drafter(heads, backbone, mm: MatmulPlan):
    """The drafter of `heads`' family, drafting with `backbone`'s embedding and LM head."""
    if heads is None:
        return None
    cls = FAMILIES[family_of(heads)].drafter_class()
    return cls(heads, backbone.lm_head, backbone.embed_tokens, mm)
