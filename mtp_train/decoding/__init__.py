"""The decoder and its parts. Plain torch + transformers; no Lightning, no Hydra.

    decoder.py     Decoder: the KV-cached loop (prefill, then plan -> draft -> verify -> accept -> commit)
    plans.py       where a step's drafts come from (nothing, a chain, a tree, a span policy, an adaptive policy)
    acceptance.py  which drafts a step keeps (exact match, relaxed, unverified)
    drafting.py    drafting a token tree level by level (static shapes, EAGLE-2 dynamic trees)
    drafters/      one drafter per head family (named by its heads/registry.py record)
    policies.py    depth policies for the adaptive plan (cost, entropy)
    matmul.py      the small-batch matmul layout, routed through every linear
    costs.py       what this machine charges: matmul layouts, verify and draft costs
    kv.py          KV-cache surgery
"""

from mtp_train.decoding.acceptance import ExactMatch, Relaxed, Unverified
from mtp_train.decoding.decoder import Decoder, DecodeResult
from mtp_train.decoding.drafting import DynamicTree, draft_tree
from mtp_train.decoding.matmul import ROW_BUCKETS, MatmulPlan, routed_linears
from mtp_train.decoding.plans import Adaptive, Chain, NoDrafts, Span, Tree
from mtp_train.decoding.policies import AcceptanceModel, CostPolicy, EntropyPolicy

__all__ = ["ROW_BUCKETS", "AcceptanceModel", "Adaptive", "Chain", "CostPolicy", "DecodeResult", "Decoder",
           "DynamicTree", "EntropyPolicy", "ExactMatch", "MatmulPlan", "NoDrafts", "Relaxed", "Span", "Tree",
           "Unverified", "draft_tree", "routed_linears"]
