"""Token trees: static tree shapes grown from the heads' rank statistics, the attention mask and
position ids of a tree forward, and greedy acceptance (docs/decoding.md, "Trees").

Pure torch and Python: no transformers, no Lightning.

A static tree is a set of *rank paths*: the node (r_1, ..., r_m) drafts, at depth m, the r_m-th most
likely candidate of head m, under the node (r_1, ..., r_{m-1}). Rank statistics say how often the
backbone's greedy token was the r-th candidate of each head at once: for a position whose ranks are
(r_1, ..., r_k) a tree accepts max{m : (r_1..r_m) in tree} drafts. Every node therefore adds exactly
the frequency of its rank path to the expected accepted length, frequencies shrink along a path, and
the best tree of n nodes is simply the n most frequent rank-path prefixes (prefix-closed by
construction): `grow_tree`.

Rank statistics are recorded at the end of training (`RankStats`, saved as `tree_stats.json` beside
the heads) on teacher-forced validation positions whose inputs lie on the backbone's greedy path, so
that what a head saw there is exactly what it sees when decoding; they are split by the backbone's
entropy at the position (EntMTP: confident positions support deeper trees).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

ENTROPY_EDGES = (0.5, 1.5, 3.0)  # nats: buckets [0, .5), [.5, 1.5), [1.5, 3), [3, inf)

RankPath = tuple[int, ...]


# ---------------------------------------------------------------------------------------------------
# tree shapes


@dataclass(frozen=True)
class TreeShape:
    """A static tree: prefix-closed rank paths in parent-before-child order (by depth, then rank)."""

    paths: tuple[RankPath, ...]

    def __post_init__(self) -> None:
        seen = set()
        for p in self.paths:
            if not p or any(r < 0 for r in p):
                raise ValueError(f"tree: bad rank path {p}")
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"tree: {p} comes before (or without) its parent {p[:-1]}")
            if p in seen:
                raise ValueError(f"tree: {p} twice")
            seen.add(p)

    @classmethod
    def chain(cls, depth: int) -> TreeShape:
        return cls(tuple((0,) * d for d in range(1, depth + 1)))

    @classmethod
    def of(cls, paths) -> TreeShape:
        """From any prefix-closed collection of rank paths (sorted into parent-before-child order)."""
        return cls(tuple(sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))))

    @property
    def n(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == (0,) * len(p) for p in self.paths)

    def parents(self) -> list[int]:
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def widths(self) -> list[int]:
        """Per depth, how many candidates of that head the tree uses (max rank + 1)."""
        w = [0] * self.depth
        for p in self.paths:
            w[len(p) - 1] = max(w[len(p) - 1], p[-1] + 1)
        return w

    def label(self) -> str:
        return f"chain{self.n}" if self.is_chain else f"tree{self.n}"


# ---------------------------------------------------------------------------------------------------
# rank statistics


@dataclass
class RankStats:
    """How often the backbone's greedy token had rank (r_1..r_k) among heads 1..k's candidates, per
    entropy bucket. A rank of `max_rank` means "not among the first max_rank" (or outside the draft
    vocabulary)."""

    k: int
    max_rank: int
    counts: list[Counter] = field(default_factory=list)  # one Counter[RankPath] per entropy bucket
    edges: tuple[float, ...] = ENTROPY_EDGES

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [Counter() for _ in range(len(self.edges) + 1)]

    @staticmethod
    def rank_cap(k: int) -> int:
        """A cap that keeps the dense count tensor (buckets x (R+1)^k) small for any k."""
        r = 16
        while r > 1 and (r + 1) ** k > 100_000:
            r -= 1
        return r

    def total(self, bucket: int | None = None) -> int:
        return sum(sum(c.values()) for c in self._pick(bucket))

    def _pick(self, bucket):
        return self.counts if bucket is None else [self.counts[bucket]]

    def prefix_counts(self, bucket: int | None = None) -> Counter:
        """Counter[rank path prefix] over every prefix whose ranks are all below max_rank."""
        out: Counter = Counter()
        for c in self._pick(bucket):
            for ranks, n in c.items():
                for m in range(1, len(ranks) + 1):
                    if ranks[m - 1] >= self.max_rank:
                        break
                    out[ranks[:m]] += n
        return out

    def add_dense(self, dense: torch.Tensor) -> None:
        """Add a (buckets, (R+1)^k) count tensor (see `dense_counts`)."""
        base = self.max_rank + 1
        for b in range(dense.shape[0]):
            nz = torch.nonzero(dense[b]).flatten().tolist()
            vals = dense[b][nz].tolist() if nz else []
            for code, v in zip(nz, vals, strict=True):
                ranks = []
                for _ in range(self.k):
                    ranks.append(code % base)
                    code //= base
                self.counts[b][tuple(reversed(ranks))] += int(v)

    def to_json(self) -> dict:
        return {"k": self.k, "max_rank": self.max_rank, "entropy_edges": list(self.edges),
                "positions": self.total(),
                "counts": [[b, *r, n] for b, c in enumerate(self.counts) for r, n in sorted(c.items())]}

    @classmethod
    def from_json(cls, d: dict) -> RankStats:
        s = cls(k=int(d["k"]), max_rank=int(d["max_rank"]), edges=tuple(d["entropy_edges"]))
        for row in d["counts"]:
            s.counts[int(row[0])][tuple(int(r) for r in row[1:-1])] += int(row[-1])
        return s

    def save(self, path: Path) -> None:
        from mtp_train.artifacts import write_json_atomic

        write_json_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: Path) -> RankStats | None:
        path = Path(path)
        if not path.is_file():
            return None
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as e:
            from mtp_train.errors import MtpError

            raise MtpError(f"{path}: not a rank-statistics file ({e})") from None


def entropy_bucket(entropy: torch.Tensor, edges=ENTROPY_EDGES) -> torch.Tensor:
    return torch.bucketize(entropy.float(), torch.tensor(edges, device=entropy.device), right=True)


def dense_counts(ranks: torch.Tensor, buckets: torch.Tensor, max_rank: int, n_buckets: int) -> torch.Tensor:
    """ranks (N, k) capped at max_rank, buckets (N,) -> (n_buckets, (R+1)^k) int64 counts, a dense
    form that data-parallel ranks can sum."""
    base = max_rank + 1
    k = ranks.shape[-1]
    code = torch.zeros(ranks.shape[0], dtype=torch.long, device=ranks.device)
    for j in range(k):
        code = code * base + ranks[:, j].clamp(max=max_rank).long()
    flat = buckets.long() * base**k + code
    return torch.bincount(flat, minlength=n_buckets * base**k).view(n_buckets, base**k)


def head_ranks(logits: torch.Tensor, target_idx: torch.Tensor, max_rank: int) -> torch.Tensor:
    """logits (..., |D|), target_idx (...) draft indices (-1 = outside the draft vocabulary) ->
    rank of the target among the logits (0 = top), capped at max_rank."""
    tgt = logits.gather(-1, target_idx.clamp(min=0)[..., None])  # (..., 1)
    rank = (logits > tgt).sum(-1)
    return torch.where(target_idx < 0, torch.full_like(rank, max_rank), rank.clamp(max=max_rank))


# ---------------------------------------------------------------------------------------------------
# growing and scoring trees


def grow_tree(prefix: Counter, budget: int, max_depth: int | None = None) -> TreeShape:
    """The `budget` most frequent rank-path prefixes (never-seen ones left out): the tree of at most
    `budget` nodes with the largest expected accepted length on these statistics."""
    items = [(p, n) for p, n in prefix.items() if n > 0 and (max_depth is None or len(p) <= max_depth)]
    items.sort(key=lambda pn: (-pn[1], len(pn[0]), pn[0]))  # a tie puts the parent first
    return TreeShape.of(p for p, _ in items[:budget])


def expected_accepted(shape: TreeShape, prefix: Counter, total: int) -> float:
    """Mean drafts accepted per step (tau - 1) on the statistics the prefix counts come from."""
    return sum(prefix.get(p, 0) for p in shape.paths) / max(1, total)


def accepted_drafts(shape: TreeShape | set, ranks: RankPath) -> int:
    paths = set(shape.paths) if isinstance(shape, TreeShape) else shape
    m = 0
    while m < len(ranks) and ranks[: m + 1] in paths:
        m += 1
    return m


def cross_fit_tau(rank_rows: torch.Tensor, budget: int, max_rank: int) -> float:
    """tau of a tree grown on one half of the positions and scored on the other (both ways, averaged):
    `val/sim_tau_tree`, free of the optimism of scoring a tree on the data it was grown from."""
    rows = [tuple(int(x) for x in r) for r in rank_rows.tolist()]
    if len(rows) < 2:
        return 1.0
    halves = rows[0::2], rows[1::2]
    taus = []
    for grow, score in (halves, halves[::-1]):
        s = RankStats(k=rank_rows.shape[1], max_rank=max_rank, edges=())
        s.counts[0].update(grow)
        shape = set(grow_tree(s.prefix_counts(), budget).paths)
        taus.append(1.0 + sum(accepted_drafts(shape, r) for r in score) / len(score))
    return sum(taus) / 2


def pareto_front(cands: list[dict]) -> list[dict]:
    """The candidates (dicts with "predicted_tau" and "cost") that no other beats on both, cheapest
    first."""
    def beaten(c):
        return any(o is not c and o["predicted_tau"] >= c["predicted_tau"] and o["cost"] <= c["cost"]
                   and (o["predicted_tau"] > c["predicted_tau"] or o["cost"] < c["cost"]) for o in cands)

    return sorted((c for c in cands if not beaten(c)), key=lambda c: c["cost"])


# ---------------------------------------------------------------------------------------------------
# a drafted tree at decode time, its mask and its acceptance


@dataclass
class DraftTree:
    """Drafted nodes in parent-before-child order. parents[i] = -1 for a child of the root (the last
    committed token); depths start at 1; scores are cumulative draft log-probabilities."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # the node's own draft probability
    ranks: list[tuple] = field(default_factory=list)  # a static tree's rank path per node
    # speculative sampling: parent (-1 = root) -> the (V,) distribution its children were drawn from,
    # without replacement, in node order; parents absent here had their children chosen outright
    proposals: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float, prob: float, ranks: tuple | None = None) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(float(score))
        self.probs.append(float(prob))
        if ranks is not None:
            self.ranks.append(tuple(ranks))
        return self.n - 1

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path_to(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def keep(self, idx: list[int]) -> DraftTree:
        """The sub-tree of the nodes `idx` (parent-closed), reindexed in their order."""
        idx = sorted(idx)
        where = {old: new for new, old in enumerate(idx)}
        t = DraftTree()
        for old in idx:
            p = self.parents[old]
            t.tokens.append(self.tokens[old])
            t.parents.append(-1 if p < 0 else where[p])
            t.depths.append(self.depths[old])
            t.scores.append(self.scores[old])
            t.probs.append(self.probs[old])
            if self.ranks:
                t.ranks.append(self.ranks[old])
        for u, q in self.proposals.items():
            # a drawn proposal still describes the kept children only if they are the first ones
            # drawn; otherwise the verifier treats them as chosen outright (lossless either way)
            drawn = [v for v, p in enumerate(self.parents) if p == u]
            kept = [v for v in drawn if v in where]
            if (u < 0 or u in where) and kept == drawn[: len(kept)]:
                t.proposals[-1 if u < 0 else where[u]] = q
        return t


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """(n, n) bool: [i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def tree_attention_mask(parents: list[int], cached: int, dtype: torch.dtype,
                        device=None) -> torch.Tensor:
    """The 4D additive mask (1, 1, n+1, cached+n+1) for a forward over [root, nodes] after `cached`
    tokens: every row sees the whole prefix, the root, and its own ancestors (0 = attend, the dtype's
    min = masked)."""
    n = len(parents)
    allow = torch.zeros(n + 1, cached + n + 1, dtype=torch.bool)
    allow[:, : cached + 1] = True  # the prefix and the root
    allow[1:, cached + 1:] = ancestor_matrix(parents)
    mask = torch.zeros(allow.shape, dtype=dtype)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def greedy_accept(tree: DraftTree, greedy: list[int]) -> list[int]:
    """greedy[0] is the backbone's choice after the root, greedy[1 + i] after node i: the accepted
    nodes, from the root down, following the child whose token equals the backbone's choice."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    path, cur = [], -1
    while True:
        want = greedy[cur + 1]
        nxt = next((c for c in children.get(cur, ()) if tree.tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt
