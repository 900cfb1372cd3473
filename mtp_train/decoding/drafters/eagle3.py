"""The decoder's drafter for EAGLE-3 heads (heads/eagle3.py)."""

from __future__ import annotations

import torch
from torch import nn

from mtp_train.decoding.matmul import MatmulPlan
from mtp_train.heads.eagle3 import attend_rows
from mtp_train.trees import DraftTree


class Eagle3Drafter:
    """EAGLE-3 heads: one draft layer with one KV cache, as an engine runs it.

    The cache holds the depth-1 row of every committed position s (inputs: the backbone's fused
    auxiliary states at s and the token x_{s+1}, rotary position s); those inputs are final once
    x_{s+1} is committed, so the rows stay. Expanding a tree node u at depth d runs a scratch row at
    position p + d with u's token and, as its hidden input, the output of u's parent's row (row p
    for a child of the root); it attends to the committed rows and to the scratch rows of u's
    ancestors and itself (training-time test's pattern). Scratch rows live for one step only: after
    verification the committed positions get their depth-1 rows from the backbone's own states."""

    def __init__(self, heads, lm_head: nn.Module, embed: nn.Module, mm: MatmulPlan):
        self.heads, self.k, self.embed, self.mm = heads, heads.k, embed, mm
        self.layer = heads.layer
        self.dtype = next(heads.parameters()).dtype
        self.weight = heads.lm_weight(lm_head).detach().to(self.dtype).contiguous()  # (|D|, d)
        self.to_tokens = heads.to_tokens
        self.reset()

    def reset(self) -> None:
        self.keys = self.values = None  # (1, H_kv, L, hd): committed positions 0..L-1
        self.last = None  # output (d,) of the last committed row

    def begin(self, tokens: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> None:
        if aux is None:
            raise ValueError("EAGLE-3 drafting needs the backbone's auxiliary states")
        self.tokens, self.aux, self.p = tokens, aux, len(tokens) - 2
        self.scratch: dict[int, tuple] = {}  # node -> (key, value, output)
        self.order: list[int] = []  # scratch nodes in key order

    def _rows(self, emb, h, positions, allow):
        """Run the layer on rows emb, h (m, d) at `positions` (m,), attending where `allow`
        (m, L + S + m) is True over [committed keys; scratch keys in order; these rows' keys]
        -> (keys, values (1, H_kv, m, hd), outputs (m, d))."""
        cos, sin = self.heads.rotary(h[None], positions[None])
        q, k, v, res = self.layer.qkv(emb[None], h[None], cos, sin)
        committed_k = [] if self.keys is None else [self.keys]
        committed_v = [] if self.values is None else [self.values]
        keys = torch.cat([*committed_k, *(self.scratch[u][0] for u in self.order), k], 2)
        values = torch.cat([*committed_v, *(self.scratch[u][1] for u in self.order), v], 2)
        out = self.layer.finish(attend_rows(self.layer, q, keys, values, allow), res)[0]
        return k, v, out

    def _commit_rows(self) -> None:
        start = 0 if self.keys is None else self.keys.shape[2]
        n = self.p + 1 - start
        if n <= 0:
            return
        dev = self.tokens.device
        emb = self.embed(self.tokens[start + 1: self.p + 2]).to(self.dtype)  # x_{s+1}, (n, d)
        h = self.heads.fuse(self.aux[start: self.p + 1].to(self.dtype))  # (n, d)
        allow = torch.ones(n, start + n, dtype=torch.bool)
        allow[:, start:] = torch.ones(n, n, dtype=torch.bool).tril()
        k, v, out = self._rows(emb, h, torch.arange(start, self.p + 1, device=dev), allow)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 2)
        self.values = v if self.values is None else torch.cat([self.values, v], 2)
        self.last = out[-1]

    def level(self, j: int, expand: list[int], tree: DraftTree) -> torch.Tensor:
        if j == 1:
            self._commit_rows()
        new = [u for u in expand if u >= 0 and u not in self.scratch]
        if new:
            dev = self.tokens.device
            emb = self.embed(torch.tensor([tree.tokens[u] for u in new], device=dev)).to(self.dtype)
            h = torch.stack([self.last if tree.parents[u] < 0 else self.scratch[tree.parents[u]][2] for u in new])
            L, S, m = self.keys.shape[2], len(self.order), len(new)
            allow = torch.zeros(m, L + S + m, dtype=torch.bool)
            allow[:, :L] = True
            col = {u: L + i for i, u in enumerate(self.order)} | {u: L + S + i for i, u in enumerate(new)}
            for i, u in enumerate(new):
                allow[i, [col[a] for a in tree.path_to(u)]] = True
            pos = torch.tensor([self.p + tree.depths[u] for u in new], device=dev)
            k, v, out = self._rows(emb, h, pos, allow)
            for i, u in enumerate(new):
                self.scratch[u] = (k[:, :, i: i + 1], v[:, :, i: i + 1], out[i])
            self.order += new
        rows = torch.stack([self.last if u < 0 else self.scratch[u][2] for u in expand])
        return torch.log_softmax(self.mm.mm(self.heads.norm(rows), self.weight).float(), -1)

