"""The decoder on the tiny backbone: exact tau and cache length with scripted drafters, lossless
verify with random heads, relaxed(B=0) == verify, EOS inside an accepted draft, adaptive depth."""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadsConfig
from mtp_train.decoding import CostPolicy, Decoder, DynamicTree, EntropyPolicy
from mtp_train.decoding.costs import measure_matmuls
from mtp_train.evaluation.decode import decode
from mtp_train.heads.persist import build_heads
from mtp_train.heads.registry import FAMILIES
from mtp_train.trees import TreeShape
from tests.helpers import ChainScript

K = 3


class ScriptedDrafter(ChainScript):
    """Drafts from a known continuation: depth j is right iff right[j - 1] (else a wrong token)."""

    def __init__(self, full: list[int], right: list[bool], vocab: int):
        super().__init__(len(right), vocab)
        self.full, self.right = full, right

    def token(self, j: int) -> int:
        at = len(self.committed) + j - 1
        true = self.full[at] if at < len(self.full) else 0
        return true if self.right[j - 1] else (true + 1) % self.vocab


def _prompts(n, seed=0, vocab=259):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _random_heads(bb, typ, draft_ids=None, seed=0, share=False):
    torch.manual_seed(seed)
    heads = build_heads(HeadsConfig(type=typ, k=K, share=share), bb, draft_ids=draft_ids)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads.eval()


@pytest.mark.parametrize("right,tau", [([True] * K, K + 1), ([False] * K, 1), ([True, False, True], 2)])
def test_scripted_drafts_give_the_exact_tau_and_cache_length(tiny_backbone, right, tau):
    bb = tiny_backbone
    prompt, new = _prompts(1)[0], 33  # 1 from the prefill + 8 steps x 4 when everything is accepted
    ref = decode(Decoder(bb, eos_ids=[]), prompt, new, "greedy")
    drafter = ScriptedDrafter(prompt + ref.tokens, right, bb.vocab_size)
    out = decode(Decoder(bb, eos_ids=[], drafter=drafter), prompt, new, "verify")
    assert out.tokens == ref.tokens
    steps = -(-(new - 1) // tau)  # ceil: the last step may be cut short by the token budget
    assert out.steps == steps
    assert out.accept_lengths[:-1] == [tau] * (steps - 1)
    assert out.cache_length == len(prompt) + new - 1  # every committed token but the last
    if right[0]:
        assert out.accepted[0] == out.reached[0]
    else:
        assert out.accepted == [0] * K and out.reached[1:] == [0] * (K - 1)


def test_clp_mode_with_accept_everything_commits_every_draft_unverified(tiny_backbone):
    bb = tiny_backbone
    prompt = _prompts(1, seed=3)[0]
    ref = decode(Decoder(bb, eos_ids=[]), prompt, 30, "greedy")
    wrong = ScriptedDrafter(prompt + ref.tokens, [False] * K, bb.vocab_size)
    out = decode(Decoder(bb, eos_ids=[], drafter=wrong), prompt, 30, "clp", span_policy=lambda h, p: K)
    assert out.tau == pytest.approx((30 - 1) / out.steps) and out.accept_lengths[0] == K + 1
    assert out.tokens != ref.tokens  # wrong drafts were kept: lossy by construction
    assert out.cache_length == len(prompt) + 30 - 1
    none = decode(Decoder(bb, eos_ids=[], drafter=wrong), prompt, 30, "clp", span_policy=lambda h, p: 0)
    assert none.tokens == ref.tokens and none.tau == 1.0


@pytest.mark.parametrize("typ,draft", [(f, d) for f in FAMILIES for d in (None, 40)])
def test_verify_is_identical_to_greedy_with_random_heads(tiny_backbone, typ, draft):
    bb = tiny_backbone
    draft_ids = None if draft is None else torch.arange(0, bb.vocab_size, bb.vocab_size // draft)[:draft]
    heads = _random_heads(bb, typ, draft_ids)
    dec = Decoder(bb, heads, eos_ids=[])
    for prompt in _prompts(12, seed=1):
        g = decode(dec, prompt, 24, "greedy")
        v = decode(dec, prompt, 24, "verify")
        r = decode(dec, prompt, 24, "relaxed", budget=0.0, delta=0.3)
        assert v.tokens == g.tokens == r.tokens
        assert v.accept_lengths == r.accept_lengths
        assert v.cache_length == len(prompt) + 23


@pytest.mark.parametrize("share", [False, True])
def test_chained_drafts_equal_the_teacher_forced_heads(tiny_backbone, share):
    """Module caches stay exact: each step's drafts are what the training-time forward predicts on
    the final sequence, wherever the drafts before them were accepted: for a chain and for a tree
    (node (r_1..r_j) under an accepted path is head j's r_j-th candidate, teacher-forced). With one
    module shared by every depth, each depth still keeps a cache of its own."""
    bb = tiny_backbone
    heads = _random_heads(bb, "chained", seed=4, share=share)
    dec = Decoder(bb, heads, eos_ids=[])
    shape = TreeShape.of([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0)])
    checked = 0
    for tree in (None, shape):
        for prompt in _prompts(5, seed=2):
            out = decode(dec, prompt, 30, "verify" if tree is None else "tree", tree=tree, trace=True)
            seq = torch.tensor([prompt + out.tokens])
            with torch.no_grad():
                h = bb.hidden_states(seq)
                logits = heads.project(heads(h, seq, bb.embed_tokens), bb.lm_head)[0]  # (T, k, V)
                order = logits.argsort(-1, descending=True)
            for p, tokens, parents, path, ranks in out.trace:
                for v, tok in enumerate(tokens):
                    anc = [] if parents[v] < 0 else [parents[v]]
                    while anc and parents[anc[-1]] >= 0:
                        anc.append(parents[anc[-1]])
                    if all(a in path for a in anc):  # its inputs are committed tokens
                        j = len(ranks[v])
                        assert tok == int(order[p, j - 1, ranks[v][-1]]), (p, v)
                        checked += 1
    assert checked > 60


class PlantedDrafter:
    """A tree drafter that knows the true continuation: under a node whose path is all correct, the
    true token gets rank ranks[j] among depth j's candidates (>= the vocabulary: absent); elsewhere
    the candidates are arbitrary."""

    def __init__(self, full: list[int], ranks_at, vocab: int, k: int):
        self.full, self.ranks_at, self.vocab, self.k = full, ranks_at, vocab, k
        self.to_tokens = lambda idx: idx

    def reset(self):
        pass

    def begin(self, tokens, hidden, aux=None):
        self.N = len(tokens)
        self.planted = self.ranks_at(self.N)

    def level(self, j, expand, tree):
        rows = []
        for u in expand:
            path = [] if u < 0 else tree.path_to(u)
            correct = all(tree.tokens[v] == self._true(i) for i, v in enumerate(path))
            order = [t for t in range(self.vocab) if t != self._true(j - 1)]
            g = torch.Generator().manual_seed(1000 * self.N + 10 * j + len(path))
            order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
            r = self.planted[j - 1]
            if correct and r < self.vocab:
                order.insert(r, self._true(j - 1))
            else:
                order.append(self._true(j - 1))
            lp = torch.empty(self.vocab)
            lp[torch.tensor(order)] = -torch.arange(self.vocab, dtype=torch.float)
            rows.append(lp)
        return torch.stack(rows)

    def _true(self, i):
        return self.full[self.N + i] if self.N + i < len(self.full) else 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_verify_is_greedy_and_accepts_exactly_the_planted_paths(tiny_backbone, seed):
    """Static trees: the accepted length per step is max{m : (r_1..r_m) in tree} for the planted
    ranks; dynamic trees and chains are lossless too; the cache length is exact."""
    bb = tiny_backbone
    prompt, new = _prompts(1, seed=seed + 10)[0], 40
    ref = decode(Decoder(bb, eos_ids=[]), prompt, new, "greedy")
    g = torch.Generator().manual_seed(seed)
    table = {}

    def ranks_at(N):
        if N not in table:
            table[N] = tuple(int(x) for x in torch.randint(0, 4, (K,), generator=g))
        return table[N]

    shape = TreeShape.of([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)])
    paths = set(shape.paths)
    for tree in (shape, TreeShape.chain(K), DynamicTree(nodes=12, topk=3, width=3)):
        drafter = PlantedDrafter(prompt + ref.tokens, ranks_at, bb.vocab_size, K)
        out = decode(Decoder(bb, eos_ids=[], drafter=drafter), prompt, new, "tree", tree=tree, trace=True)
        assert out.tokens == ref.tokens
        assert out.cache_length == len(prompt) + new - 1
        if isinstance(tree, TreeShape):
            tree_paths = set(tree.paths)
            for (p, *_), kept in zip(out.trace, out.accept_lengths, strict=True):
                planted = table.get(p + 2, (K,) * K)  # absent: the step drafted nothing
                room = new - (p + 2 - len(prompt)) - 1  # drafts the token budget still allowed
                want = 0
                while want < min(K, room) and planted[: want + 1] in tree_paths:
                    want += 1
                assert kept - 1 == want, (p, planted, kept)
    assert any(len(set(table[n][:1])) for n in table) and paths


def test_kv_cache_equals_sequential_decoding_after_every_tree_step(tiny_backbone):
    from transformers import DynamicCache

    bb = tiny_backbone
    checked = []

    class Checking(Decoder):
        def _commit(self, st, d, path, out, logits, aux, accept):
            super()._commit(st, d, path, out, logits, aux, accept)
            ref = DynamicCache()
            self.forward(st.tokens[:-1], ref)
            assert st.cache.get_seq_length() == ref.get_seq_length() == len(st.tokens) - 1
            for a, b in zip(st.cache.layers, ref.layers, strict=True):
                torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)
            checked.append(len(path))

    for typ in FAMILIES:
        heads = _random_heads(bb, typ, seed=7)
        dec = Checking(bb, heads, eos_ids=[])
        shape = TreeShape.of([(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)])
        for prompt in _prompts(3, seed=8):
            decode(dec, prompt, 20, "tree", tree=shape)
            decode(dec, prompt, 20, "dynamic", tree=DynamicTree(nodes=8, topk=2, width=2))
    assert len(checked) > 20 and max(checked) >= 1  # some steps kept drafts off the first branch too


def test_tree_forward_matches_a_slow_per_node_reference(tiny_backbone):
    """Each node's backbone state in one tree forward equals a plain forward of prefix + its path."""
    from transformers import DynamicCache

    from mtp_train.trees import DraftTree, tree_attention_mask

    bb = tiny_backbone
    prompt = _prompts(1, seed=9)[0]
    tree = DraftTree()
    for tok, parent in [(5, -1), (6, -1), (7, 0), (8, 0), (9, 1), (10, 2), (11, 4)]:
        tree.add(tok, parent, 0.0, 1.0)
    dec = Decoder(bb, eos_ids=[])
    with torch.no_grad():
        cache = DynamicCache()
        dec.forward(torch.tensor(prompt[:-1]), cache)
        L = len(prompt) - 1
        ids = torch.tensor([prompt[-1], *tree.tokens])
        pos = torch.tensor([[L] + [L + x for x in tree.depths]])
        mask = tree_attention_mask(tree.parents, L, torch.float32)
        out = dec.forward(ids, cache, attention_mask=mask, position_ids=pos)
        for v in range(tree.n):
            seq = prompt + [tree.tokens[a] for a in tree.path_to(v)]
            ref = bb.hidden_states(torch.tensor([seq]))[0, -1]
            torch.testing.assert_close(out[1 + v], ref, atol=1e-5, rtol=1e-4)
    # the mask itself, against its definition
    for i in range(tree.n + 1):
        for c in range(L + tree.n + 1):
            node = c - L - 1
            allowed = c <= L or (i > 0 and node in tree.path_to(i - 1))
            assert (mask[0, 0, i, c] == 0) == allowed, (i, c)


def test_bf16_decoding_equals_a_bf16_greedy_loop(tiny_backbone):
    import copy

    from transformers import DynamicCache

    bb = copy.copy(tiny_backbone)
    bb.model = copy.deepcopy(tiny_backbone.model).to(torch.bfloat16)
    heads = _random_heads(tiny_backbone, "chained", seed=3).to(torch.bfloat16)
    dec = Decoder(bb, heads, eos_ids=[])
    shape = TreeShape.of([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    for prompt in _prompts(4, seed=11):
        with torch.no_grad():  # the slow reference: one token per forward, bf16 throughout
            cache, seq, out = DynamicCache(), list(prompt), []
            logits = bb.model(torch.tensor([seq]), cache=cache, use_cache=True).logits[0, -1]
            for _ in range(20):
                out.append(int(logits.argmax()))
                logits = bb.model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[0, -1]
        g = decode(dec, prompt, 20, "greedy")
        assert g.tokens == out
        assert decode(dec, prompt, 20, "tree", tree=shape).tokens == out


def test_eos_inside_an_accepted_draft_stops_where_greedy_stops(tiny_backbone):
    bb = tiny_backbone
    prompt = _prompts(1, seed=5)[0]
    ref = decode(Decoder(bb, eos_ids=[]), prompt, 30, "greedy")
    eos = ref.tokens[6]  # declare the 7th greedy token an end-of-sequence token
    first = ref.tokens.index(eos)
    g = decode(Decoder(bb, eos_ids=[eos]), prompt, 30, "greedy")
    drafter = ScriptedDrafter(prompt + ref.tokens, [True] * K, bb.vocab_size)
    v = decode(Decoder(bb, eos_ids=[eos], drafter=drafter), prompt, 30, "verify")
    assert g.tokens == v.tokens == ref.tokens[: first + 1]
    assert g.stopped == v.stopped == "eos"


def test_adaptive_drafts_fewer_heads_when_acceptance_is_low(tiny_backbone):
    bb = tiny_backbone
    prompt = _prompts(1, seed=6)[0]
    ref = decode(Decoder(bb, eos_ids=[]), prompt, 40, "greedy")
    cost = [1.0, 1.1, 1.2, 1.3]
    counts = {}
    for name, right in (("good", [True] * K), ("bad", [False] * K)):
        drafter = ScriptedDrafter(prompt + ref.tokens, right, bb.vocab_size)
        out = decode(Decoder(bb, eos_ids=[], drafter=drafter), prompt, 40, "adaptive", depth_policy=CostPolicy.chains(K, cost))
        assert out.tokens == ref.tokens  # adaptive verifies: still lossless
        counts[name] = sum(out.drafted[5:]) / len(out.drafted[5:])
    assert counts["bad"] < 0.5 <= K - 0.5 <= counts["good"]
    ent = EntropyPolicy.chains(K, low=0.5, high=3.0)
    ent.update(None, (), entropy=0.0)
    assert ent.choose().n == K
    ent.update(None, (), entropy=5.0)
    assert ent.choose().n == 0


@pytest.mark.bad_input
def test_bad_mode_arguments_are_refused(tiny_backbone):
    dec = Decoder(tiny_backbone, eos_ids=[])
    with pytest.raises(ValueError, match="needs heads"):
        decode(dec, [5, 6], 4, "verify")
    with pytest.raises(ValueError, match="unknown decoding mode"):
        decode(dec, [5, 6], 4, "beam")


@pytest.mark.parametrize("layout", ["L", "T", "P"])
def test_routed_linears_compute_the_same_in_every_layout_and_are_undone(layout):
    from torch import nn

    from mtp_train.decoding import ROW_BUCKETS, MatmulPlan, routed_linears

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5, bias=False))
    plan = MatmulPlan({MatmulPlan.key(m.weight): [layout] * len(ROW_BUCKETS) for m in (net[0], net[2])})
    for shape in [(1, 8), (3, 8), (2, 4, 8), (200, 8)]:  # one row, a few, batched, beyond the buckets
        x = torch.randn(*shape)
        ref = net(x)
        with routed_linears(plan, net), torch.no_grad():
            got = net(x)
            assert "forward" in vars(net[0])  # patched on the instance
        torch.testing.assert_close(got, ref.detach())
    assert "forward" not in vars(net[0]) and "forward" not in vars(net[2])


def test_a_packed_weight_is_packed_once_and_again_after_it_changes():
    """The "P" layout multiplies through oneDNN's packed copy of W: made on first use, reused while
    W is unchanged, remade after an in-place change (a stale copy would compute with old weights)."""
    from mtp_train.decoding import ROW_BUCKETS, MatmulPlan
    from mtp_train.decoding.matmul import can_pack

    torch.manual_seed(0)
    w, x = torch.randn(24, 8), torch.randn(3, 8)
    assert can_pack(w)  # float32 on the CPU: every oneDNN build packs it
    plan = MatmulPlan({MatmulPlan.key(w): ["P"] * len(ROW_BUCKETS)})
    torch.testing.assert_close(plan.mm(x, w), x @ w.T)
    first = plan.packed(w)
    assert plan.packed(w) is first
    with torch.no_grad():
        w.mul_(2)
    assert plan.packed(w) is not first
    torch.testing.assert_close(plan.mm(x, w), x @ w.T)
    other = MatmulPlan(plan.choices)
    other.adopt_packed(plan)
    assert other.packed(w) is plan.packed(w)



def test_measured_layout_covers_every_weight_and_keeps_decoding_lossless(tiny_backbone):
    from mtp_train.decoding import ROW_BUCKETS, MatmulPlan

    bb = tiny_backbone
    heads = _random_heads(bb, "chained", seed=5)
    dec = Decoder(bb, heads, eos_ids=[])
    plan = measure_matmuls(dec, reps=1, buckets=(1, 4))
    for m in (bb.model, heads):
        for lin in (x for x in m.modules() if type(x) is torch.nn.Linear):
            choice = plan.choices[MatmulPlan.key(lin.weight)]
            four = ROW_BUCKETS.index(4)
            assert len(choice) == len(ROW_BUCKETS) and choice[1] == choice[2] == "L"  # not measured: F.linear
            assert {choice[0], choice[four]} <= {"L", "T", "P"}
    prompt = _prompts(1, seed=12)[0]
    assert decode(dec, prompt, 20, "verify").tokens == decode(Decoder(bb, eos_ids=[]), prompt, 20, "greedy").tokens


def test_drafting_past_the_budget_drafts_every_head_to_the_end_as_the_engine_does(tiny_backbone):
    """`draft_past_budget` (mtp-serve-check, vLLM's way): the last steps draft all K heads though
    the token budget ends inside the chain, count what they keep, and the output is still cut at
    max_new_tokens, equal to greedy's."""
    bb = tiny_backbone
    prompt, new = _prompts(1, seed=5)[0], 31  # 1 + 7 steps x 4 + a last step with room for 1 draft
    ref = decode(Decoder(bb, eos_ids=[]), prompt, new + K + 1, "greedy")
    drafter = ScriptedDrafter(prompt + ref.tokens, [True] * K, bb.vocab_size)
    cut = decode(Decoder(bb, eos_ids=[], drafter=drafter), prompt, new, "verify")
    assert cut.drafted == [K] * 7 + [1] and cut.accepted == [8, 7, 7]
    full = decode(Decoder(bb, eos_ids=[], drafter=drafter, draft_past_budget=True), prompt, new, "verify")
    assert full.tokens == cut.tokens == ref.tokens[:new]
    assert full.drafted == [K] * 8 and full.accepted == [8, 8, 8]


def test_a_weight_made_in_inference_mode_can_be_packed():
    from mtp_train.decoding import ROW_BUCKETS, MatmulPlan

    with torch.inference_mode():
        w, x = torch.randn(24, 8), torch.randn(2, 8)
        plan = MatmulPlan({MatmulPlan.key(w): ["P"] * len(ROW_BUCKETS)})
        torch.testing.assert_close(plan.mm(x, w), x @ w.T)
        assert plan.packed(w) is plan.packed(w)


def _isotonic_reference(values):
    """The slow closed form of the nearest non-decreasing sequence: fit_i = max over j <= i of the
    min over m >= i of mean(values[j..m])."""
    n = len(values)
    return [max(min(sum(values[j:m + 1]) / (m + 1 - j) for m in range(i, n)) for j in range(i + 1))
            for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_the_monotone_fit_equals_the_slow_closed_form(seed):
    from mtp_train.decoding.costs import monotone

    g = torch.Generator().manual_seed(seed)
    values = (torch.arange(9) * 0.2 + torch.randn(9, generator=g) * 0.4).tolist()
    fit = monotone(values)
    assert fit == pytest.approx(_isotonic_reference(values))
    assert all(a <= b + 1e-12 for a, b in zip(fit, fit[1:], strict=False))
    assert monotone([1.0, 1.37, 1.40, 1.32, 1.61]) == pytest.approx([1.0, 1.3633333, 1.3633333, 1.3633333, 1.61])


class _DriftingDecoder:
    """A stand-in decoder whose forward over n tokens takes cost(n) x the machine's current speed on
    a fake clock; the speed moves in slow phases, as a shared host's does."""

    def __init__(self, cost, phases):
        from mtp_train.decoding.matmul import MatmulPlan

        self.cost, self.phases, self.now, self.calls = cost, phases, 0.0, 0
        self.weight, self.device, self.mm = torch.zeros(16, 4), "cpu", MatmulPlan()

    def routing(self):
        import contextlib

        return contextlib.nullcontext()

    def forward(self, ids, cache):
        self.calls += 1
        self.now += self.cost(len(ids)) * self.phases(self.calls)
        return torch.zeros(len(ids), 4)

    def clock(self) -> float:
        return self.now


def test_verify_costs_read_each_size_against_its_neighbours_so_slow_phases_cancel():
    """The host's speed changes by 1.6x every 5 forwards; each size is still read at its true cost
    relative to one token, because it is timed between two one-token forwards. Medians of each size's
    own times across rounds (no pairing) would mix phases."""
    from mtp_train.decoding.costs import verify_costs

    true = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.2, 6: 1.4, 8: 1.6, 16: 2.5}
    dec = _DriftingDecoder(lambda n: 0.05 * true[n] if n in true else 0.05 * n,
                           lambda call: 1.6 if (call // 5) % 2 else 1.0)
    curve = verify_costs(dec, sizes=tuple(true), context=4, rounds=7, clock=dec.clock)
    assert curve["costs"][1] == 1.0
    for n, c in true.items():
        assert curve["costs"][n] == pytest.approx(c, rel=0.02), n
    assert list(curve["costs"]) == sorted(true)
    lo, hi = curve["spread"][4]
    assert lo <= curve["raw"][4] <= hi


def test_draft_costs_are_read_in_one_token_forwards_timed_beside_them(monkeypatch):
    """Drafting is priced in one-token forwards, each draft timed between two of them: with the
    host's speed changing 1.6x every 10 calls (a draft and the forwards beside it take 4), every plan
    still reads its true cost to 3%; an empty plan costs nothing. Absolute draft times over a
    one-token time taken elsewhere would mix phases."""
    import types

    import mtp_train.decoding.costs as costs_mod
    from mtp_train.trees import TreeShape

    chain, tree, empty = TreeShape.chain(3), TreeShape(((0,), (1,), (0, 0))), TreeShape(())
    true = {chain.paths: 0.25, tree.paths: 0.12}
    dec = _DriftingDecoder(lambda n: 0.05 * n, lambda call: 1.6 if (call // 10) % 2 else 1.0)
    dec.k, dec.drafter = 3, types.SimpleNamespace(reset=lambda: None)
    dec.forward_aux = lambda ids, cache: (dec.forward(ids, cache), None)

    def fake_draft(drafter, tokens, hidden, plan, max_depth, aux=None):
        dec.calls += 1
        dec.now += 0.05 * true[plan.paths] * dec.phases(dec.calls)

    monkeypatch.setattr(costs_mod, "draft_tree", fake_draft)
    crops = []
    monkeypatch.setattr(costs_mod, "crop_to", lambda cache, n: crops.append(n))
    got = costs_mod.draft_costs(dec, [chain, empty, tree], list(range(6)), rounds=7, clock=dec.clock)
    assert crops and set(crops) == {6}  # every reference forward is cropped back to the prompt
    assert got["costs"][0] == pytest.approx(0.25, rel=0.03)
    assert got["costs"][1] == 0.0
    assert got["costs"][2] == pytest.approx(0.12, rel=0.03)
    assert got["one_token_ms"] == pytest.approx(50.0 * 1.3, rel=0.25)


def test_paired_ratios_time_every_item_between_two_references_in_rotating_order():
    from mtp_train.decoding.costs import paired_ratios

    calls = []

    def unit():
        calls.append("u")
        return 1.0

    def item(x):
        calls.append(x)
        return {"a": 2.0, "b": 3.0}[x]

    ratios, units = paired_ratios(["a", "b"], item, unit, rounds=2, warmup=1)
    assert ratios == {"a": [2.0, 2.0], "b": [3.0, 3.0]}
    assert units == [1.0] * 6  # per timed round: one reference before each item, and the last
    assert calls == ["u", "a", "u", "b", "u", "u", "b", "u", "a", "u", "u", "a", "u", "b", "u"]


def test_verify_costs_never_fall_with_more_tokens_and_keep_the_raw_medians():
    """A size that reads cheaper than a smaller one (noise; here planted: 6 tokens as fast as 3) is
    pooled with its neighbours; the raw medians stay in the curve."""
    from mtp_train.decoding.costs import verify_costs

    true = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.4, 6: 1.2, 8: 1.6}
    dec = _DriftingDecoder(lambda n: 0.05 * true[n], lambda call: 1.0)
    curve = verify_costs(dec, sizes=tuple(true), context=4, rounds=3, clock=dec.clock)
    assert curve["raw"][6] == pytest.approx(1.2) and curve["raw"][4] == pytest.approx(1.4)
    assert curve["costs"][4] == curve["costs"][6] == pytest.approx(1.3)
    costs = list(curve["costs"].values())
    assert all(a <= b for a, b in zip(costs, costs[1:], strict=False))
