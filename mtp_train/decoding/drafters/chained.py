"""The decoder's drafter for chained MTP modules (heads/chained.py)."""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.decoding.kv import crop_to
from mtp_train.decoding.matmul import MatmulPlan
from mtp_train.trees import DraftTree


class ChainedDrafter:
    """Chained MTP modules with one KV cache each.

    Module j at position s reads (h^{j-1}_s, token x_{s+j}). With p the last backbone position and
    the root x_{p+1}, a tree node v at depth d corresponds, for module j, to position p + 1 + d - j
    with input token(v) and, as h^{j-1}, module j-1's row for v's parent. Drafting level j runs module
    j once over (a) the rows whose inputs are now committed (positions from its cache length up to
    p + 1 - j; they stay in its cache) and (b) scratch rows for the nodes on the paths to the nodes
    being expanded, attending to the prefix and their own ancestors only (a tree mask with explicit
    positions); the scratch rows are cropped from the cache afterwards. Committed rows are exactly
    what teacher-forced training computes; so are the scratch rows of any path whose drafts are all
    the backbone's own tokens."""

    def __init__(self, heads, lm_head: nn.Module, embed: nn.Module, mm: MatmulPlan):
        from transformers import DynamicCache

        self.heads, self.k, self.embed, self.mm = heads, heads.k, embed, mm
        self.dtype = next(heads.parameters()).dtype  # the heads may draft in another dtype than the backbone's
        self.weight = heads.draft_weight(lm_head).detach().to(self.dtype).contiguous()  # (|D|, d)
        self.to_tokens = heads.to_tokens
        self._cache_cls = DynamicCache
        self.reset()

    def reset(self) -> None:
        self.caches = [self._cache_cls() for _ in range(self.k)]
        self.states: list[torch.Tensor | None] = [None] * self.k  # module j's committed rows 0..

    def begin(self, tokens: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> None:
        self.tokens, self.hidden, self.p = tokens, hidden, len(tokens) - 2
        self.scratch: list[dict[int, torch.Tensor]] = [{} for _ in range(self.k)]

    def level(self, j: int, expand: list[int], tree: DraftTree) -> torch.Tensor:
        p, cache = self.p, self.caches[j - 1]
        prev = self.hidden if j == 1 else self.states[j - 2]  # module j-1's committed rows
        start, last = cache.get_seq_length(), p + 1 - j
        n_c = max(0, last + 1 - start)
        need = sorted({a for u in expand if u >= 0 for a in tree.path_to(u)})
        scratch = [v for v in need if p + 1 + tree.depths[v] - j >= 0]
        toks = [self.tokens[start + j: last + j + 1]] if n_c else []
        if scratch:
            toks.append(torch.tensor([tree.tokens[v] for v in scratch], device=self.tokens.device))
        prev_rows = [prev[start: last + 1]] if n_c else []
        prev_rows += [prev[p + 2 - j] if tree.parents[v] < 0 else self.scratch[j - 2][tree.parents[v]]
                      for v in scratch]
        x_prev = torch.cat([r if r.dim() == 2 else r[None] for r in prev_rows]).to(self.dtype)  # (m, d)
        emb = self.embed(torch.cat(toks)).to(self.dtype)  # (m, d)
        mask = pos = None
        m = n_c + len(scratch)
        positions = [*range(start, last + 1)] + [p + 1 + tree.depths[v] - j for v in scratch]
        chain = all(tree.parents[v] == scratch[i - 1] for i, v in enumerate(scratch) if i)
        if not (chain and positions == list(range(start, start + m))):  # else a plain causal forward
            pos = torch.tensor(positions, device=emb.device)[None]
            allow = torch.zeros(m, start + m, dtype=torch.bool)
            allow[:, :start] = True
            allow[:n_c, start: start + n_c] = torch.tril(torch.ones(n_c, n_c, dtype=torch.bool))
            allow[n_c:, start: start + n_c] = True
            where = {v: i for i, v in enumerate(scratch)}
            for i, v in enumerate(scratch):
                for a in tree.path_to(v):
                    if a in where:
                        allow[n_c + i, start + n_c + where[a]] = True
            mask = torch.zeros(allow.shape, dtype=emb.dtype)
            mask.masked_fill_(~allow, torch.finfo(emb.dtype).min)
            mask = mask[None, None].to(emb.device)
        out = self.heads.module_step(j, x_prev[None], emb[None], attention_mask=mask, cache=cache,
                                     position_ids=pos)[0]  # (m, d)
        crop_to(cache, start + n_c)  # scratch rows never stay
        if n_c:
            old = self.states[j - 1]
            self.states[j - 1] = out[:n_c] if old is None or start == 0 else torch.cat([old[:start], out[:n_c]])
        self.scratch[j - 1] = {v: out[n_c + i] for i, v in enumerate(scratch)}
        rows = torch.stack([self.states[j - 1][last] if u < 0 else self.scratch[j - 1][u] for u in expand])
        return torch.log_softmax(self.mm.mm(rows, self.weight).float(), -1)  # (len(expand), |D|)

