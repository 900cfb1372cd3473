"""Token trees: growing static trees from rank statistics (against brute force), the counts, the
mask, greedy acceptance, and the adaptive policies that choose among trees."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

from mtp_train.decoding import AcceptanceModel, CostPolicy, EntropyPolicy
from mtp_train.trees import (
    DraftTree,
    RankStats,
    TreeShape,
    accepted_drafts,
    ancestor_matrix,
    cross_fit_tau,
    dense_counts,
    entropy_bucket,
    expected_accepted,
    greedy_accept,
    grow_tree,
    head_ranks,
)


def _random_stats(seed: int, k: int = 2, max_rank: int = 3, n: int = 300) -> RankStats:
    rng = random.Random(seed)
    s = RankStats(k=k, max_rank=max_rank)
    for _ in range(n):  # skewed towards rank 0, like real heads
        ranks = tuple(min(max_rank, int(rng.expovariate(1.2))) for _ in range(k))
        s.counts[rng.randrange(len(s.counts))][ranks] += 1
    return s


@pytest.mark.parametrize("seed,budget", [(0, 3), (1, 4), (2, 5), (3, 6)])
def test_grown_tree_is_the_best_prefix_closed_tree_of_its_size(seed, budget):
    """Brute force over every prefix-closed set of `budget` rank paths (k=2, ranks 0..2)."""
    stats = _random_stats(seed)
    rows = [r for c in stats.counts for r, n in c.items() for _ in range(n)]
    prefix, total = stats.prefix_counts(), stats.total()
    universe = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    best = 0.0
    for combo in itertools.combinations(universe, budget):
        paths = set(combo)
        if any(len(p) > 1 and p[:-1] not in paths for p in paths):
            continue
        best = max(best, sum(accepted_drafts(paths, r) for r in rows) / len(rows))
    grown = grow_tree(prefix, budget)
    assert grown.n <= budget
    assert expected_accepted(grown, prefix, total) == pytest.approx(best)
    # and the shortcut agrees with counting accepted drafts position by position
    assert expected_accepted(grown, prefix, total) == pytest.approx(
        sum(accepted_drafts(grown, r) for r in rows) / len(rows))


def test_tree_shape_is_checked_and_ordered():
    t = TreeShape.of([(1, 0), (0,), (1,), (0, 0)])
    assert t.paths == ((0,), (1,), (0, 0), (1, 0))
    assert t.parents() == [-1, -1, 0, 1] and t.widths() == [2, 1] and t.depth == 2
    assert TreeShape.chain(3).is_chain and TreeShape.chain(3).label() == "chain3"
    with pytest.raises(ValueError, match="parent"):
        TreeShape(((0, 0),))
    with pytest.raises(ValueError, match="twice"):
        TreeShape(((0,), (0,)))


def test_dense_counts_round_trip_and_json():
    g = torch.Generator().manual_seed(0)
    ranks = torch.randint(0, 6, (500, 3), generator=g)
    ranks[ranks == 5] = 4  # cap
    ent = torch.rand(500, generator=g) * 5
    buckets = entropy_bucket(ent)
    s = RankStats(k=3, max_rank=4)
    s.add_dense(dense_counts(ranks, buckets, 4, 4))
    slow = [Counter() for _ in range(4)]
    for r, b in zip(ranks.tolist(), buckets.tolist(), strict=True):
        slow[b][tuple(r)] += 1
    assert s.counts == slow and s.total() == 500
    for e, b in zip(ent.tolist(), buckets.tolist(), strict=True):
        assert b == sum(e >= x for x in (0.5, 1.5, 3.0))
    again = RankStats.from_json(s.to_json())
    assert again.counts == s.counts and again.k == 3 and again.max_rank == 4
    # prefixes stop at the first capped rank
    one = RankStats(k=3, max_rank=4)
    one.counts[0][(0, 4, 1)] = 7
    assert one.prefix_counts() == Counter({(0,): 7})


def test_head_ranks_against_a_slow_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 3, 50, generator=g)
    target = torch.randint(-1, 50, (40, 3), generator=g)
    got = head_ranks(logits, target, max_rank=8)
    for i in range(40):
        for j in range(3):
            t = int(target[i, j])
            want = 8 if t < 0 else min(8, sorted(logits[i, j].tolist(), reverse=True).index(logits[i, j, t].item()))
            assert int(got[i, j]) == want


def test_cross_fit_tau_scores_on_the_other_half():
    rows = torch.tensor([[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]] * 10)
    assert cross_fit_tau(rows, 16, 16) == pytest.approx(4.0)  # both kinds appear in both halves
    # the halves (even / odd positions) share nothing: a tree grown on one accepts nothing on the
    # other, though either half alone would score its own tree at 4.0
    disjoint = torch.tensor([[0, 0, 0], [2, 2, 2]] * 10)
    assert cross_fit_tau(disjoint, 3, 16) == pytest.approx(1.0)


def test_greedy_accept_and_the_ancestor_matrix_against_definitions():
    tree = DraftTree()
    for tok, parent in [(5, -1), (6, -1), (7, 0), (7, 1), (9, 2), (3, 3)]:
        tree.add(tok, parent, 0.0, 1.0)
    # greedy[0] after the root, greedy[1 + i] after node i
    assert greedy_accept(tree, [6, 0, 7, 0, 3, 0, 0]) == [1, 3, 5]
    assert greedy_accept(tree, [5, 7, 0, 9, 0, 0, 0]) == [0, 2, 4]
    assert greedy_accept(tree, [4, 0, 0, 0, 0, 0, 0]) == []
    anc = ancestor_matrix(tree.parents)
    for i in range(tree.n):
        for j in range(tree.n):
            assert bool(anc[i, j]) == (j in tree.path_to(i))


def test_acceptance_model_and_cost_policy_choose_by_expected_tokens_per_cost():
    prefix = Counter({(0,): 50, (1,): 20, (0, 0): 30, (0, 1): 5})
    model = AcceptanceModel(prefix, total=100, prior_weight=1000.0)  # the prior dominates
    small, big = TreeShape.of([(0,)]), TreeShape.of([(0,), (1,), (0, 0), (0, 1)])
    assert model.expected(small) == pytest.approx(0.5, abs=1e-6)
    assert model.expected(big) == pytest.approx(expected_accepted(big, prefix, 100), abs=1e-6)
    pol = CostPolicy([TreeShape(()), small, big], [1.0, 1.1, 1.3], model)
    assert pol.choose() == big  # 2.05 / 1.3 > 1.5 / 1.1 > 1
    pol = CostPolicy([TreeShape(()), small, big], [1.0, 1.1, 3.0], model)
    assert pol.choose() == small
    # observations move the estimate: depth-1 rank 0 never right -> q falls
    fresh = AcceptanceModel(prefix, total=100, prior_weight=2.0)
    before = fresh.q((0,))
    for _ in range(30):
        fresh.update(big, ())
    assert fresh.q((0,)) < before / 5
    # a policy stuck on "no drafts" still probes the smallest tree
    stuck = CostPolicy([TreeShape(()), small], [1.0, 5.0], probe=4)
    picks = [stuck.choose().n for _ in range(8)]
    assert picks.count(1) == 2 and picks.count(0) == 6


def test_entropy_policy_picks_the_tree_of_the_bucket():
    trees = [TreeShape.chain(3), TreeShape.chain(2), TreeShape.chain(1), TreeShape(())]
    pol = EntropyPolicy(trees, (0.5, 1.5, 3.0))
    for h, want in [(0.1, 3), (1.0, 2), (2.0, 1), (4.0, 0)]:
        pol.update(None, (), entropy=h)
        assert pol.choose().n == want
    with pytest.raises(ValueError, match="edges"):
        EntropyPolicy(trees[:2], (0.5, 1.5, 3.0))
