"""The decoder on the tiny backbone: exact tau and cache length with scripted drafters, lossless
verify with random heads, relaxed(B=0) == verify, EOS inside an accepted draft, adaptive depth."""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadsConfig
from mtp_train.decoding import CostPolicy, Decoder, EntropyPolicy
from mtp_train.heads import build_heads

K = 3


class ScriptedDrafter:
    """Drafts from a known continuation: depth j is right iff right[j] (else a wrong token)."""

    def __init__(self, full: list[int], right: list[bool], vocab: int):
        self.full, self.right, self.vocab, self.k = full, right, vocab, len(right)

    def reset(self):
        pass

    def draft(self, tokens, hidden, n):
        N = len(tokens)
        out = []
        for j in range(n):
            true = self.full[N + j] if N + j < len(self.full) else 0
            out.append(true if self.right[j] else (true + 1) % self.vocab)
        return torch.tensor(out, dtype=torch.long), torch.full((n,), 0.5)

    def commit(self, n_before, kept):
        pass


def _prompts(n, seed=0, vocab=259):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _random_heads(bb, typ, draft_ids=None, seed=0):
    torch.manual_seed(seed)
    heads = build_heads(HeadsConfig(type=typ, k=K), bb, draft_ids=draft_ids)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads.eval()


@pytest.mark.parametrize("right,tau", [([True] * K, K + 1), ([False] * K, 1), ([True, False, True], 2)])
def test_scripted_drafts_give_the_exact_tau_and_cache_length(tiny_backbone, right, tau):
    bb = tiny_backbone
    prompt, new = _prompts(1)[0], 33  # 1 from the prefill + 8 steps x 4 when everything is accepted
    ref = Decoder(bb, eos_ids=[]).generate(prompt, new, "greedy")
    drafter = ScriptedDrafter(prompt + ref.tokens, right, bb.vocab_size)
    out = Decoder(bb, eos_ids=[], drafter=drafter).generate(prompt, new, "verify")
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
    ref = Decoder(bb, eos_ids=[]).generate(prompt, 30, "greedy")
    wrong = ScriptedDrafter(prompt + ref.tokens, [False] * K, bb.vocab_size)
    out = Decoder(bb, eos_ids=[], drafter=wrong).generate(prompt, 30, "clp", span_policy=lambda h, p: K)
    assert out.tau == pytest.approx((30 - 1) / out.steps) and out.accept_lengths[0] == K + 1
    assert out.tokens != ref.tokens  # wrong drafts were kept: lossy by construction
    assert out.cache_length == len(prompt) + 30 - 1
    none = Decoder(bb, eos_ids=[], drafter=wrong).generate(prompt, 30, "clp", span_policy=lambda h, p: 0)
    assert none.tokens == ref.tokens and none.tau == 1.0


@pytest.mark.parametrize("typ,draft", [("chained", None), ("medusa", None), ("chained", 40), ("medusa", 40)])
def test_verify_is_identical_to_greedy_with_random_heads(tiny_backbone, typ, draft):
    bb = tiny_backbone
    draft_ids = None if draft is None else torch.arange(0, bb.vocab_size, bb.vocab_size // draft)[:draft]
    heads = _random_heads(bb, typ, draft_ids)
    dec = Decoder(bb, heads, eos_ids=[])
    for prompt in _prompts(12, seed=1):
        g = dec.generate(prompt, 24, "greedy")
        v = dec.generate(prompt, 24, "verify")
        r = dec.generate(prompt, 24, "relaxed", budget=0.0, delta=0.3)
        assert v.tokens == g.tokens == r.tokens
        assert v.accept_lengths == r.accept_lengths
        assert v.cache_length == len(prompt) + 23


def test_chained_drafts_equal_the_teacher_forced_heads(tiny_backbone):
    """Module caches stay exact: each step's drafts are what the training-time forward predicts on
    the final sequence, wherever the drafts before them were accepted."""
    bb = tiny_backbone
    heads = _random_heads(bb, "chained", seed=4)
    dec = Decoder(bb, heads, eos_ids=[])
    checked = 0
    for prompt in _prompts(6, seed=2):
        out = dec.generate(prompt, 30, "verify", trace=True)
        seq = torch.tensor([prompt + out.tokens])
        with torch.no_grad():
            h = bb.hidden_states(seq)
            tf = heads.project(heads(h, seq, bb.embed_tokens), bb.lm_head).argmax(-1)[0]  # (T, k)
        for p, drafts, kept in out.trace:
            # depth j (1-based) read drafts 1..j-1 as inputs: exact where they were all kept
            for j in range(min(len(drafts), kept + 1)):
                assert drafts[j] == int(tf[p, j]), (p, j)
                checked += 1
    assert checked > 20


def test_eos_inside_an_accepted_draft_stops_where_greedy_stops(tiny_backbone):
    bb = tiny_backbone
    prompt = _prompts(1, seed=5)[0]
    ref = Decoder(bb, eos_ids=[]).generate(prompt, 30, "greedy")
    eos = ref.tokens[6]  # declare the 7th greedy token an end-of-sequence token
    first = ref.tokens.index(eos)
    g = Decoder(bb, eos_ids=[eos]).generate(prompt, 30, "greedy")
    drafter = ScriptedDrafter(prompt + ref.tokens, [True] * K, bb.vocab_size)
    v = Decoder(bb, eos_ids=[eos], drafter=drafter).generate(prompt, 30, "verify")
    assert g.tokens == v.tokens == ref.tokens[: first + 1]
    assert g.stopped == v.stopped == "eos"


def test_adaptive_drafts_fewer_heads_when_acceptance_is_low(tiny_backbone):
    bb = tiny_backbone
    prompt = _prompts(1, seed=6)[0]
    ref = Decoder(bb, eos_ids=[]).generate(prompt, 40, "greedy")
    cost = [1.0, 1.1, 1.2, 1.3]
    counts = {}
    for name, right in (("good", [True] * K), ("bad", [False] * K)):
        drafter = ScriptedDrafter(prompt + ref.tokens, right, bb.vocab_size)
        out = Decoder(bb, eos_ids=[], drafter=drafter).generate(
            prompt, 40, "adaptive", depth_policy=CostPolicy(K, cost))
        assert out.tokens == ref.tokens  # adaptive verifies: still lossless
        counts[name] = sum(out.drafted[5:]) / len(out.drafted[5:])
    assert counts["bad"] < 0.5 <= K - 0.5 <= counts["good"]
    ent = EntropyPolicy(K, low=0.5, high=3.0)
    ent.update(K, 0, entropy=0.0)
    assert ent.choose() == K
    for _ in range(6):
        ent.update(K, 0, entropy=5.0)
    assert ent.choose() == 0


def test_bad_mode_arguments_are_refused(tiny_backbone):
    dec = Decoder(tiny_backbone, eos_ids=[])
    with pytest.raises(ValueError, match="needs heads"):
        dec.generate([5, 6], 4, "verify")
    with pytest.raises(ValueError, match="unknown decoding mode"):
        dec.generate([5, 6], 4, "beam")


def test_small_batch_linears_compute_the_same_and_are_undone():
    from torch import nn

    from mtp_train.decoding import small_batch_linears, small_mm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5, bias=False))
    for shape in [(1, 8), (3, 8), (2, 4, 8), (40, 8)]:  # one row, a few, batched, beyond SMALL_ROWS
        x = torch.randn(*shape)
        ref = net(x)
        with small_batch_linears(net), torch.no_grad():
            got = net(x)
            assert "forward" in vars(net[0])  # patched on the instance
        torch.testing.assert_close(got, ref.detach())
    assert "forward" not in vars(net[0]) and "forward" not in vars(net[2])
    w = torch.randn(7, 8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(small_mm(x, w), x @ w.T)
