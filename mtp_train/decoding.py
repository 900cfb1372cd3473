"""The bundled decoder: batch-size-1, KV-cached, "the backbone makes the next token, the heads draft
the ones after it" (Backbone-as-Architect). Plain torch + transformers; no Lightning, no Hydra.

One step, with x the last committed token (made by the backbone, not yet fed to it) and p the
position of the last backbone hidden state:

    1. plan    what to draft: nothing (greedy), a chain of n drafts, a static tree shape or a
               dynamic tree (`_plan`)
    2. draft   the heads draft a tree of nodes under x, level by level (`draft_tree`; a chain is the
               one-branch tree)
    3. verify  the backbone reads [x, nodes] in one forward: each node attends to the cached prefix,
               x and its own ancestors, at position N - 1 + depth (`_verify`; a chain is a plain
               causal forward)
    4. accept  the mode picks the path to keep (`_accept`): verify follows, from x, the child whose
               token equals the backbone's greedy choice (lossless); relaxed and clp keep a prefix of
               a chain
    5. commit  the kept path plus the backbone's token after it are committed; the KV rows of the
               kept path are compacted into place (every layer), so the cache equals what sequential
               greedy decoding would hold (`_commit`)

Modes (docs/decoding.md):
    greedy     our own one-token loop (the reference)
    verify     lossless verification of a chain of k drafts, or of `tree=` (a TreeShape: static,
               Medusa-style; a DynamicTree: EAGLE-2-style): output identical to greedy
    relaxed    keep chain draft d_i while p(d_i) >= delta * max p and the summed log-prob drift
               sum_i (log max p - log p(d_i)) stays <= budget; budget 0 is verify
    clp        a span-length policy picks m drafts to commit unverified (lossy); a policy that reads
               only h_p is asked before drafting, so only m heads run
    clp+verify the policy's m caps how many chain drafts go to verification (lossless)
    adaptive   verify with the tree chosen per step by a policy: `CostPolicy` (expected committed
               tokens per unit of measured step cost, from running acceptance) or `EntropyPolicy`
               (EntMTP: the tree grown for the backbone's current entropy bucket)

Chained MTP modules keep one KV cache each holding only rows whose inputs are committed; tree rows
are scratch and are cropped after the step (`ChainedDrafter`). Stopping is HF `generate`'s: after
max_new_tokens, or on an end-of-sequence token, which is kept.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mtp_train.backbone import cut_at_eos
from mtp_train.choices import DECODER_MODES
from mtp_train.heads.eagle3 import attend_rows
from mtp_train.trees import DraftTree, TreeShape, greedy_accept, tree_attention_mask

MODES = DECODER_MODES


@dataclass
class DecodeResult:
    tokens: list[int]  # the new tokens (EOS included when it stopped there)
    steps: int = 0  # backbone forwards after the prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per step (>= 1)
    reached: list[int] = field(default_factory=list)  # per depth: steps whose accepted path got to depth j-1
    accepted: list[int] = field(default_factory=list)  # per depth: steps that kept a depth-j draft
    drafted: list[int] = field(default_factory=list)  # draft nodes verified per step
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped: str = "length"  # "eos" | "length"
    cache_length: int = 0  # the backbone's KV cache at the end: prompt + committed - 1
    # trace=True: per step (position p, tree tokens, tree parents, accepted node indices, the nodes'
    # rank paths when the tree was static)
    trace: list[tuple] | None = None
    # record=True: per step that drafted a chain of all k heads, (h_p (d,), the heads' top-1 probs
    # (k,), kept): CLP's acceptance labels when the mode is verify
    records: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2-style: at each level expand the `width` best frontier nodes (cumulative draft
    log-probability) into their `topk` candidates each, then keep the best `nodes` overall."""

    nodes: int = 16
    topk: int = 4
    width: int = 4
    depth: int | None = None  # None = every head

    def label(self) -> str:
        return f"dynamic{self.nodes}"


# ---------------------------------------------------------------------------------------------------
# matmul layout, chosen by timing it on this machine


ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class MatmulPlan:
    """For each weight shape and dtype the decoder multiplies, and each row-count bucket, whether to
    compute x @ W^T as `F.linear` or as `W @ x^T`. On an AVX2 EPYC with this torch's MKL the first
    costs about rows x its one-row cost for 2-8 rows while the second stays flat; on an AVX-512/AMX
    Xeon it is the other way round (docs/decoding.md). `Decoder.measure_matmuls` decides by timing
    whole forwards (timing each weight alone, hot in cache, picked worse layouts on the EPYC); an
    unknown shape uses F.linear."""

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


def _crop_to(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _keep_rows(cache, idx: torch.Tensor) -> None:
    """Keep only the sequence rows `idx` of every layer's keys and values."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


# ---------------------------------------------------------------------------------------------------
# drafters: what the heads propose under the last committed token. A drafter has `k`, `reset()`,
# `begin(tokens, hidden)` once per step and `level(j, expand, tree)` -> log-probabilities (m, |D|)
# of depth-j candidates under each node of `expand` (node indices, -1 = the root), plus `to_tokens`.


class MedusaDrafter:
    """Parallel heads: every depth reads the backbone's h_p, whatever the drafts above it, so one
    matmul per step gives every depth's candidates."""

    def __init__(self, heads, lm_head: nn.Module, mm: MatmulPlan):
        self.heads, self.k, self.mm = heads, heads.k, mm
        self.dtype = next(heads.parameters()).dtype
        self.weight = (None if heads.lm_heads is not None else
                       heads.draft_weight(lm_head).detach().to(self.dtype).contiguous())
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
                logits = torch.stack([self.heads.lm_heads[j](hh[j]) for j in range(self.k)])
            self._lp = torch.log_softmax(logits.float(), -1)
        return self._lp

    def level(self, j: int, expand: list[int], tree: DraftTree) -> torch.Tensor:
        return self._all()[j - 1].expand(len(expand), -1)


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
        _crop_to(cache, start + n_c)  # scratch rows never stay
        if n_c:
            old = self.states[j - 1]
            self.states[j - 1] = out[:n_c] if old is None or start == 0 else torch.cat([old[:start], out[:n_c]])
        self.scratch[j - 1] = {v: out[n_c + i] for i, v in enumerate(scratch)}
        rows = torch.stack([self.states[j - 1][last] if u < 0 else self.scratch[j - 1][u] for u in expand])
        return torch.log_softmax(self.mm.mm(rows, self.weight).float(), -1)  # (len(expand), |D|)


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
        self.weight = heads.head_weight(lm_head).detach().to(self.dtype).contiguous()  # (|D|, d)
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


def make_drafter(heads, backbone, mm: MatmulPlan):
    if heads is None:
        return None
    if getattr(heads, "aux_layers", None):
        return Eagle3Drafter(heads, backbone.lm_head, backbone.embed_tokens, mm)
    if hasattr(heads, "module_step"):
        return ChainedDrafter(heads, backbone.lm_head, backbone.embed_tokens, mm)
    return MedusaDrafter(heads, backbone.lm_head, mm)


def draft_tree(drafter, tokens: torch.Tensor, hidden: torch.Tensor, plan, max_depth: int,
               aux: torch.Tensor | None = None) -> DraftTree:
    """Draft the nodes `plan` asks for (a TreeShape or a DynamicTree), level by level, no deeper than
    `max_depth`; `aux` (N - 1, n * d): the backbone's auxiliary states, for EAGLE-3 heads. A drafter
    with only `draft(tokens, hidden, n)` (tests' scripted drafters) drafts chains."""
    tree = DraftTree()
    if isinstance(plan, TreeShape):
        depth = min(plan.depth, max_depth)
    else:
        depth = min(plan.depth or drafter.k, drafter.k, max_depth)
    if depth <= 0 or (isinstance(plan, TreeShape) and plan.n == 0):
        return tree
    if not hasattr(drafter, "level"):
        n = min(depth, plan.depth if isinstance(plan, TreeShape) else depth)
        drafts, probs = drafter.draft(tokens, hidden, n)
        for i, (t, q) in enumerate(zip(drafts.tolist(), probs.tolist(), strict=True)):
            tree.add(t, i - 1, 0.0, q, ranks=(0,) * (i + 1))
        return tree
    if aux is None:  # drafters that read no auxiliary states may take two arguments (tests' planted ones)
        drafter.begin(tokens, hidden)
    else:
        drafter.begin(tokens, hidden, aux)
    if isinstance(plan, TreeShape):
        node_of: dict[tuple, int] = {(): -1}
        by_depth: dict[int, list[tuple]] = {}
        for path in plan.paths:
            if len(path) <= depth:
                by_depth.setdefault(len(path), []).append(path)
        for j in range(1, depth + 1):
            paths = by_depth.get(j, [])
            parents = sorted({node_of[pth[:-1]] for pth in paths})
            if not paths:
                break
            lp = drafter.level(j, parents, tree)  # (len(parents), |D|)
            width = max(pth[-1] for pth in paths) + 1
            top_lp, top_idx = lp.topk(min(width, lp.shape[-1]), -1)
            tok = drafter.to_tokens(top_idx).tolist()
            row = {u: i for i, u in enumerate(parents)}
            top_lp = top_lp.tolist()
            for pth in paths:
                u, r = node_of[pth[:-1]], pth[-1]
                if r >= len(tok[row[u]]):
                    continue
                base = 0.0 if u < 0 else tree.scores[u]
                node_of[pth] = tree.add(tok[row[u]][r], u, base + top_lp[row[u]][r], math.exp(top_lp[row[u]][r]),
                                        ranks=pth)
        return tree
    frontier = [-1]
    for j in range(1, depth + 1):
        lp = drafter.level(j, frontier, tree)
        top_lp, top_idx = lp.topk(min(plan.topk, lp.shape[-1]), -1)
        tok, top_lp = drafter.to_tokens(top_idx).tolist(), top_lp.tolist()
        new = []
        for i, u in enumerate(frontier):
            base = 0.0 if u < 0 else tree.scores[u]
            for r in range(len(tok[i])):
                new.append(tree.add(tok[i][r], u, base + top_lp[i][r], math.exp(top_lp[i][r])))
        frontier = sorted(new, key=lambda v: -tree.scores[v])[: plan.width]
    if tree.n > plan.nodes:  # scores only fall along a path, so the best n are parent-closed
        best = sorted(range(tree.n), key=lambda v: (-tree.scores[v], tree.depths[v]))[: plan.nodes]
        keep = set(best)
        for v in best:
            keep.update(tree.path_to(v))
        tree = tree.keep(sorted(keep))
    return tree


# ---------------------------------------------------------------------------------------------------
# adaptive policies: which tree to verify at this step


class AcceptanceModel:
    """Running estimate of how many drafts a static tree gets accepted: per rank path P, the chance
    that P's draft is the backbone's token given its parent was, from prior rank statistics (worth
    `prior_weight` steps; Beta(1, 1) without statistics) updated by every verified step."""

    def __init__(self, prefix=None, total: int = 0, prior_weight: float = 8.0):
        self.prefix, self.total, self.w = prefix or {}, total, prior_weight
        self.succ: dict[tuple, float] = {}
        self.trials: dict[tuple, float] = {}

    def q(self, path: tuple) -> float:
        if self.total:
            parent = self.prefix.get(path[:-1], 0) if len(path) > 1 else self.total
            s0 = self.w * self.prefix.get(path, 0) / self.total
            t0 = self.w * parent / self.total
        else:
            s0, t0 = 1.0, 2.0
        return (s0 + self.succ.get(path, 0.0)) / max(1e-9, t0 + self.trials.get(path, 0.0))

    def expected(self, shape: TreeShape) -> float:
        out, chance = 0.0, {(): 1.0}
        for path in shape.paths:
            chance[path] = chance.get(path[:-1], 0.0) * self.q(path)
            out += chance[path]
        return out

    def update(self, shape: TreeShape, accepted_ranks: tuple) -> None:
        for path in shape.paths:
            m = len(path)
            if path[:-1] == accepted_ranks[: m - 1] and len(accepted_ranks) >= m - 1:
                self.trials[path] = self.trials.get(path, 0.0) + 1
                self.succ[path] = self.succ.get(path, 0.0) + float(accepted_ranks[:m] == path)


class CostPolicy:
    """Pick, each step, the candidate tree maximising E[committed tokens] / cost: E = 1 + the
    running expected accepted drafts (`AcceptanceModel`), cost = the measured time of verifying
    n + 1 tokens plus drafting the tree, relative to a plain one-token step. When "no drafts" wins,
    the smallest tree is still tried every `probe` steps, so the estimates can recover."""

    def __init__(self, trees: list[TreeShape], costs: list[float], model: AcceptanceModel | None = None,
                 probe: int = 16):
        self.trees, self.costs, self.model, self.probe = trees, costs, model or AcceptanceModel(), probe
        self._idle = 0

    @classmethod
    def chains(cls, k: int, cost: list[float]) -> CostPolicy:
        """Chains of 0..k drafts with `cost[n]` for n drafts."""
        return cls([TreeShape.chain(n) for n in range(k + 1)], list(cost))

    def choose(self, **_) -> TreeShape:
        rates = [(1 + self.model.expected(t)) / c for t, c in zip(self.trees, self.costs, strict=True)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if self.trees[best].n == 0:
            self._idle += 1
            if self._idle >= self.probe:
                self._idle = 0
                return min((t for t in self.trees if t.n), key=lambda t: t.n, default=self.trees[best])
        return self.trees[best]

    def update(self, shape: TreeShape, accepted_ranks: tuple, **_) -> None:
        if shape.n:
            self.model.update(shape, accepted_ranks)


class EntropyPolicy:
    """EntMTP: one tree per entropy bucket of the backbone (deeper where it is confident), chosen by
    the entropy of the distribution that made the last committed token. `edges` are the bucket
    boundaries in nats; `trees[b]` is verified in bucket b."""

    def __init__(self, trees: list[TreeShape], edges=(0.5, 1.5, 3.0)):
        if len(trees) != len(edges) + 1:
            raise ValueError(f"EntropyPolicy: {len(edges)} edges need {len(edges) + 1} trees, got {len(trees)}")
        self.trees, self.edges, self.h = trees, tuple(edges), 0.0

    @classmethod
    def chains(cls, k: int, low: float = 0.5, high: float = 3.0) -> EntropyPolicy:
        """Without rank statistics: all k heads at or below `low` nats, none at or above `high`."""
        mid = (low + high) / 2
        return cls([TreeShape.chain(k), TreeShape.chain(max(1, k // 2 + k % 2)),
                    TreeShape.chain(1), TreeShape.chain(0)], (low, mid, high))

    def choose(self, entropy: float | None = None, **_) -> TreeShape:
        h = self.h if entropy is None else entropy
        return self.trees[sum(h >= e for e in self.edges)]

    def update(self, shape: TreeShape, accepted_ranks: tuple, entropy: float = 0.0, **_) -> None:
        self.h = entropy


# ---------------------------------------------------------------------------------------------------
# the decoder


@dataclass
class _State:
    tokens: torch.Tensor  # committed tokens (N,)
    hidden: torch.Tensor  # backbone states (N - 1, d)
    cache: object  # the backbone's KV cache: N - 1 rows
    new: list[int]  # the new tokens so far
    entropy: float = 0.0  # of the distribution that made the last committed token
    aux: torch.Tensor | None = None  # (N - 1, n * d): the auxiliary layers' states, for EAGLE-3 heads


class Decoder:
    """Decode one prompt at a time with a frozen backbone (a `backbone.Backbone`) and optional heads."""

    def __init__(self, backbone, heads=None, eos_ids: list[int] | None = None, drafter=None,
                 matmul: MatmulPlan | None = None):
        """`drafter` replaces the heads' own (tests); `matmul` routes small-batch linears (None: each
        Decoder measures its own plan on first use)."""
        self.backbone = backbone
        self.base = backbone.model.base_model  # transformer without the LM head
        self.weight = backbone.lm_head.weight.detach()  # (V, d)
        self.heads = self.draft_heads = heads
        self.aux_layers = getattr(heads, "aux_layers", None)  # backbone layers the heads read (EAGLE-3)
        self._mm = matmul
        self.drafter = drafter if drafter is not None else make_drafter(heads, backbone, self.mm)
        self.k = self.drafter.k if self.drafter is not None else 0
        tok = backbone.tokenizer
        self.eos = set(eos_ids if eos_ids is not None else [tok.eos_token_id])
        self.device = backbone.device

    @property
    def mm(self) -> MatmulPlan:
        if self._mm is None:
            self._mm = MatmulPlan()
        return self._mm

    def measure_matmuls(self, reps: int = 4, context: int = 128, buckets=ROW_BUCKETS) -> MatmulPlan:
        """For each row-count bucket, time a whole backbone forward of that many tokens (LM head
        included) with every linear as `F.linear` and with every linear as `W @ x^T`, interleaved,
        medians of `reps` after a warm-up round, and route that bucket through the faster layout
        from now on (heads and draft projections included)."""
        from transformers import DynamicCache

        mods = [m for m in (self.backbone.model, self.heads) if m is not None]
        weights = [lin.weight for m in mods for lin in m.modules() if type(lin) is nn.Linear]
        weights += [self.weight] + ([self.drafter.weight] if getattr(self.drafter, "weight", None) is not None else [])
        keys = {MatmulPlan.key(w) for w in weights}
        plans = {t: MatmulPlan({key: [t] * len(ROW_BUCKETS) for key in keys}) for t in (False, True)}
        use_t = [False] * len(ROW_BUCKETS)
        ids = torch.randint(0, self.weight.shape[0], (context + max(buckets),),
                            generator=torch.Generator().manual_seed(0)).to(self.device)
        with torch.inference_mode():
            cache = DynamicCache()
            self._forward(ids[:context], cache)
            for i, rows in enumerate(ROW_BUCKETS):
                if rows not in buckets:
                    continue
                times = {False: [], True: []}
                for r in range(reps + 1):
                    for t in ((False, True) if r % 2 else (True, False)):
                        with routed_linears(plans[t], *mods):
                            t0 = time.perf_counter()
                            out = self._forward(ids[context: context + rows], cache)
                            plans[t].mm(out, self.weight).argmax(-1)
                            dt = time.perf_counter() - t0
                        _crop_to(cache, context)
                        if r:
                            times[t].append(dt)
                use_t[i] = statistics.median(times[True]) < statistics.median(times[False])
        self.mm.choices.update({key: list(use_t) for key in keys})
        return self.mm

    def set_draft_dtype(self, dtype: torch.dtype) -> None:
        """Draft with a copy of the heads in `dtype`. Drafts need not be exact (verification is), so
        the heads may draft in a cheaper dtype than the backbone verifies in: on an AVX2 EPYC a bf16
        module reads its weights in two thirds of the float32 time, native bf16 or not."""
        import copy

        if self.heads is None or next(self.draft_heads.parameters()).dtype == dtype:
            return
        same = next(self.heads.parameters()).dtype == dtype
        self.draft_heads = self.heads if same else copy.deepcopy(self.heads).to(dtype)
        self.drafter = make_drafter(self.draft_heads, self.backbone, self.mm)

    @property
    def draft_dtype(self) -> torch.dtype | None:
        return None if self.draft_heads is None else next(self.draft_heads.parameters()).dtype

    def _routing(self):
        return routed_linears(self.mm, *(m for m in (self.backbone.model, self.draft_heads) if m is not None))

    def _forward(self, ids: torch.Tensor, cache, **kw) -> torch.Tensor:
        """(n,) tokens after the cached ones -> backbone states (n, d); the cache grows by n."""
        return self.base(input_ids=ids[None], cache=cache, use_cache=True, **kw).last_hidden_state[0]

    def _forward_aux(self, ids: torch.Tensor, cache, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `_forward`, plus the inputs of the heads' auxiliary layers (n, n_aux * d) (or None)."""
        if not self.aux_layers:
            return self._forward(ids, cache, **kw), None
        hidden, aux = self.backbone.hidden_and_aux(ids[None], aux_layers=self.aux_layers, cache=cache,
                                                   use_cache=True, **kw)
        return hidden[0], aux[0]

    def generate(self, prompt: list[int], max_new_tokens: int, mode: str = "greedy", **opts) -> DecodeResult:
        """Decode `prompt` (token ids) for at most max_new_tokens new tokens; see `_generate`."""
        with self._routing(), torch.inference_mode():
            return self._generate(prompt, max_new_tokens, mode, **opts)

    def _generate(self, prompt: list[int], max_new_tokens: int, mode: str = "greedy", *, tree=None,
                  span_policy=None, delta: float = 0.5, budget: float = 0.0, depth_policy=None,
                  trace: bool = False, record: bool = False) -> DecodeResult:
        """Decode `prompt` for at most max_new_tokens new tokens.

        tree (verify): a TreeShape (static) or DynamicTree; None = the chain of all k heads.
        span_policy (clp, clp+verify): callable(hidden (d,), head_probs (k,) or None) -> m in 0..k,
            the drafts to keep (clp) or to verify (clp+verify); with `needs_probs = False` it is
            asked before drafting, with head_probs None.
        delta, budget (relaxed): see the module docstring; budget=0 is exact greedy verification.
        depth_policy (adaptive): a CostPolicy or EntropyPolicy (anything with choose/update).
        """
        from transformers import DynamicCache

        self._check(mode, span_policy, depth_policy)
        k = self.k
        res = DecodeResult(tokens=[], reached=[0] * k, accepted=[0] * k, trace=[] if trace else None,
                           records=[] if record else None)
        if self.drafter is not None:
            self.drafter.reset()
        t0 = time.perf_counter()
        cache = DynamicCache()
        ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device)
        hidden, aux = self._forward_aux(ids, cache)  # (P, d), (P, n * d) or None
        logits = self.mm.mm(hidden[-1:], self.weight)
        first = int(logits[0].argmax())
        st = _State(tokens=torch.cat([ids, torch.tensor([first], device=self.device)]), hidden=hidden,
                    cache=cache, new=[first], entropy=_entropy(logits[0]), aux=aux)
        res.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        while not self._done(st.new, max_new_tokens):
            room = max_new_tokens - len(st.new) - 1  # no draft past the token budget
            plan = self._plan(mode, tree, st, span_policy, depth_policy)
            d = draft_tree(self.drafter, st.tokens, st.hidden, plan, room, st.aux) if self.drafter else DraftTree()
            if mode in ("clp", "clp+verify") and getattr(span_policy, "needs_probs", True) and d.n:
                d = d.keep(list(range(min(d.n, int(span_policy(st.hidden[-1], torch.tensor(d.probs)))))))
            out, logits, aux = self._verify(st, d)
            path = self._accept(mode, d, logits, delta, budget)
            n_before = len(st.tokens)
            self._commit(st, d, path, out, logits, aux)
            self._record(res, st, d, path, plan, n_before, mode, depth_policy, trace, record)
        res.decode_s = time.perf_counter() - t1
        res.cache_length = st.cache.get_seq_length()
        res.tokens, res.stopped = self._truncate(st.new, max_new_tokens)
        return res

    # --- the step, in parts -----------------------------------------------------------------------

    def _check(self, mode, span_policy, depth_policy) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown decoding mode {mode!r}; expected one of {', '.join(MODES)}")
        if mode != "greedy" and self.drafter is None:
            raise ValueError(f"mode {mode!r} needs heads")
        if mode in ("clp", "clp+verify") and span_policy is None:
            raise ValueError(f"mode {mode!r} needs a span_policy")
        if mode == "adaptive" and depth_policy is None:
            raise ValueError("mode 'adaptive' needs a depth_policy")

    def _plan(self, mode, tree, st: _State, span_policy, depth_policy):
        """What to draft this step: a TreeShape (a chain is one) or a DynamicTree."""
        if mode == "greedy":
            return TreeShape(())
        if mode == "adaptive":
            return depth_policy.choose(entropy=st.entropy)
        if mode in ("clp", "clp+verify") and getattr(span_policy, "needs_probs", True) is False:
            return TreeShape.chain(int(span_policy(st.hidden[-1], None)))  # only the heads it will use
        if mode == "verify" and tree is not None:
            return tree
        return TreeShape.chain(self.k)

    def _verify(self, st: _State, d: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One backbone forward over [x, nodes] -> states (n + 1, d), logits (n + 1, V) and the
        auxiliary layers' states (n + 1, n_aux * d) or None."""
        ids = torch.cat([st.tokens[-1:], torch.tensor(d.tokens, dtype=torch.long, device=self.device)])
        if d.is_chain():
            out, aux = self._forward_aux(ids, st.cache)
        else:
            cached = st.cache.get_seq_length()
            pos = torch.tensor([cached] + [cached + x for x in d.depths], device=self.device)[None]
            mask = tree_attention_mask(d.parents, cached, st.hidden.dtype, self.device)
            out, aux = self._forward_aux(ids, st.cache, attention_mask=mask, position_ids=pos)
        return out, self.mm.mm(out, self.weight), aux

    def _accept(self, mode: str, d: DraftTree, logits: torch.Tensor, delta: float, budget: float) -> list[int]:
        """The node indices to keep, root first."""
        if mode in ("greedy", "clp"):
            return list(range(d.n))  # clp: a chain, committed unverified
        if mode == "relaxed":
            drafts = torch.tensor(d.tokens, dtype=torch.long, device=logits.device)
            return list(range(self._relaxed(logits[: d.n], drafts, delta, budget)))
        return greedy_accept(d, logits.argmax(-1).tolist())

    def _commit(self, st: _State, d: DraftTree, path: list[int], out: torch.Tensor, logits: torch.Tensor,
                aux: torch.Tensor | None = None) -> None:
        """Commit the path and the backbone's token after it; keep the path's KV rows and states."""
        rows = [0] + [1 + v for v in path]  # rows of [x, nodes] to keep
        cached = st.cache.get_seq_length() - (d.n + 1)
        if rows == list(range(len(rows))):
            _crop_to(st.cache, cached + len(rows))
        else:
            _keep_rows(st.cache, torch.cat([torch.arange(cached), cached + torch.tensor(rows)]).to(self.device))
        last = rows[-1]
        bonus = int(logits[last].argmax())
        committed = [d.tokens[v] for v in path] + [bonus]
        st.hidden = torch.cat([st.hidden, out[rows]])
        if aux is not None:
            st.aux = torch.cat([st.aux, aux[rows]])
        st.tokens = torch.cat([st.tokens, torch.tensor(committed, dtype=torch.long, device=self.device)])
        st.new.extend(committed)
        st.entropy = _entropy(logits[last])

    def _record(self, res: DecodeResult, st: _State, d: DraftTree, path, plan, n_before, mode,
                depth_policy, trace, record) -> None:
        kept = len(path)
        parents = set(d.parents)
        for j in range(min(self.k, kept + 1)):  # depth j+1 was reached if the path's node has children
            if (path[j - 1] if j else -1) not in parents:
                break
            res.reached[j] += 1
            res.accepted[j] += int(j < kept)
        if trace:
            res.trace.append((n_before - 2, list(d.tokens), list(d.parents), list(path), list(d.ranks)))
        if record and d.n == self.k and d.is_chain():
            res.records.append((st.hidden[n_before - 2].clone(), torch.tensor(d.probs), kept))
        if mode == "adaptive":
            depth_policy.update(plan, d.ranks[path[-1]] if path and d.ranks else (), entropy=st.entropy)
        res.steps += 1
        res.drafted.append(d.n)
        res.accept_lengths.append(kept + 1)

    def _done(self, new: list[int], max_new_tokens: int) -> bool:
        return len(new) >= max_new_tokens or any(t in self.eos for t in new)

    def _truncate(self, new: list[int], max_new_tokens: int) -> tuple[list[int], str]:
        return cut_at_eos(new, self.eos, max_new_tokens)

    @staticmethod
    def _relaxed(logits: torch.Tensor, drafts: torch.Tensor, delta: float, budget: float) -> int:
        """Chain-aware relaxed acceptance (Match the Distribution): keep d_i while
        p(d_i) >= delta * max p and sum of (log max p - log p(d_i)) so far <= budget."""
        logp = torch.log_softmax(logits.float(), -1)  # (n, V)
        top = logp.max(-1).values  # (n,)
        mine = logp.gather(-1, drafts[:, None])[:, 0]  # (n,)
        drift, kept = 0.0, 0
        for i in range(len(drafts)):
            gap = float(top[i] - mine[i])
            if gap > -math.log(delta) + 1e-12 or drift + gap > budget + 1e-12:
                break
            drift += gap
            kept += 1
        return kept

    # --- what this machine charges for a step -------------------------------------------------------

    def verify_costs(self, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), context: int = 128,
                     rounds: int = 7, warmup: int = 2) -> dict:
        """Wall time of one backbone forward over n new tokens (plus the LM head and argmax) after
        `context` cached tokens, relative to n = 1: medians of `rounds` interleaved rounds (the order
        of sizes rotates per round) after `warmup` untimed ones. Returns {"costs": {n: ratio},
        "one_token_ms", "spread": {n: [min, max] ratio}}."""
        with self._routing(), torch.inference_mode():
            from transformers import DynamicCache

            sizes = sorted(set(sizes) | {1})
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, self.weight.shape[0], (context + max(sizes),), generator=g).to(self.device)
            cache = DynamicCache()
            self._forward(ids[:context], cache)
            times = {n: [] for n in sizes}
            for r in range(warmup + rounds):
                order = sizes[r % len(sizes):] + sizes[: r % len(sizes)]
                for n in order:
                    t0 = time.perf_counter()
                    out = self._forward(ids[context: context + n], cache)
                    self.mm.mm(out, self.weight).argmax(-1)
                    dt = time.perf_counter() - t0
                    _crop_to(cache, context)
                    if r >= warmup:
                        times[n].append(dt)
            one = statistics.median(times[1])
            return {"costs": {n: statistics.median(t) / one for n, t in times.items()},
                    "spread": {n: [min(t) / one, max(t) / one] for n, t in times.items()},
                    "one_token_ms": one * 1e3, "context": context, "rounds": rounds}

    def draft_cost(self, plan, prompt: list[int], reps: int = 5) -> float:
        """Median wall time of drafting `plan` after `prompt` (seconds), warm."""
        if self.drafter is None or (isinstance(plan, TreeShape) and plan.n == 0):
            return 0.0
        with self._routing(), torch.inference_mode():
            from transformers import DynamicCache

            ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device)
            hidden, aux = self._forward_aux(ids, DynamicCache())
            tokens = torch.cat([ids, ids[-1:]])
            times = []
            for r in range(reps + 1):
                self.drafter.reset()
                if hasattr(self.drafter, "level"):  # fill the module caches: a step then drafts warm
                    draft_tree(self.drafter, tokens[:-1], hidden[:-1], TreeShape.chain(self.k), self.k,
                               None if aux is None else aux[:-1])
                t0 = time.perf_counter()
                draft_tree(self.drafter, tokens, hidden, plan, self.k, aux)
                if r:
                    times.append(time.perf_counter() - t0)
            self.drafter.reset()
            return statistics.median(times)


def _entropy(logits: torch.Tensor) -> float:
    lp = torch.log_softmax(logits.float(), -1)
    return float(-(lp.exp() * lp).sum())
