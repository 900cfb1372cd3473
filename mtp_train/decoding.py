"""The bundled decoder: batch-size-1, KV-cached, "the backbone makes the next token, the heads draft
the k after it" (Backbone-as-Architect). Plain torch + transformers; no Lightning, no Hydra.

One step of every drafting mode, with x the last committed token (made by the backbone, not yet fed
to it) and p the position of the last backbone hidden state:

    1. the heads draft d_1..d_n at p (n <= k; chained modules run sequentially, each reading the
       token the previous one drafted; Medusa heads in one matmul)
    2. the backbone reads [x, d_1..d_n] in one forward (its cache grows by 1 + n), giving its greedy
       token g_i after each of them
    3. the mode decides how many drafts a to keep; the cache is cropped back to the kept tokens and
       the commit is x's successors d_1..d_a plus a backbone token (g_a for verify and relaxed)

Modes (ALGORITHMS.md, "Decoding modes"):
    greedy     our own one-token loop (the reference; n = 0 every step)
    verify     a = longest prefix with d_i == g_{i-1}: output identical to greedy
    relaxed    keep d_i while p(d_i) >= delta * max p and the chain's summed log-prob drift
               sum_i (log max p - log p(d_i)) stays <= budget; budget 0 is verify
    clp        a span-length policy chooses a = m from the backbone state before the forward and the
               backbone reads only [x, d_1..d_m]: no verification (lossy), a forward of m + 1 tokens;
               a policy that reads only h_p (no head probabilities) is asked before drafting, so
               only m heads run
    clp+verify the policy's m caps how many drafts go to verification (lossless, fewer wasted
               verify tokens)
    adaptive   verify with n chosen per step: policy "cost" maximises expected committed tokens per
               second from running per-depth acceptance and the measured forward cost of n + 1
               tokens; policy "entropy" drafts deeper where the backbone's running entropy is low

Chained MTP modules keep one KV cache each. Module j at position s reads token x_{s+j}, so after a
step that kept a drafts its entries are exact (as in teacher-forced training) up to position
N - 1 + a - j, N the committed length before the step; the rest are cropped and recomputed next step
(at most j positions per module per step).

Stopping is HF `generate`'s: after max_new_tokens, or on an end-of-sequence token, which is kept.
"""

from __future__ import annotations

import contextlib
import math
import time
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("greedy", "verify", "relaxed", "clp", "clp+verify", "adaptive")


@dataclass
class DecodeResult:
    tokens: list[int]  # the new tokens (EOS included when it stopped there)
    steps: int = 0  # backbone forwards after the prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per step (>= 1)
    reached: list[int] = field(default_factory=list)  # per depth: steps whose chain got to depth j
    accepted: list[int] = field(default_factory=list)  # per depth: steps that kept depth j's draft
    drafted: list[int] = field(default_factory=list)  # heads run per step
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stopped: str = "length"  # "eos" | "length"
    cache_length: int = 0  # the backbone's KV cache at the end: prompt + committed - 1
    trace: list[tuple[int, list[int], int]] | None = None  # (position p, drafts, kept) per step
    # record=True: per step that drafted all k heads, (h_p (d,), the heads' top-1 probs (k,), kept):
    # CLP's acceptance labels when the mode is verify (kept = leading drafts equal to greedy)
    records: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


# ---------------------------------------------------------------------------------------------------
# small-batch matmuls: decoding multiplies every weight by 1..k+1 rows. With MKL on these CPUs,
# F.linear (x @ W^T) costs about m times its one-row cost for m = 2..8 rows, while W @ x^T (the
# weight as the left operand) stays flat: 4 rows through SmolLM2's LM head take 34 ms one way and
# 7.5 ms the other (bench/decode.py prints the resulting step cost). Verification is only cheap if
# k+1 tokens cost little more than 1, so the decoder routes small-batch linears through W @ x^T.

SMALL_ROWS = 16


def small_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (m, d) @ weight (n, d)^T for small m, computed as (weight @ x^T)^T (one row: F.linear,
    which is as fast there)."""
    if x.shape[0] == 1:
        return F.linear(x, weight)
    return torch.mm(weight, x.T).T


def _small_batch_linear(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    if rows > SMALL_ROWS or rows == 1 or x.requires_grad or x.dim() < 2:
        return F.linear(x, self.weight, self.bias)
    y = small_mm(x.reshape(rows, x.shape[-1]), self.weight).contiguous()  # callers .view() it
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], self.weight.shape[0])


@contextlib.contextmanager
def small_batch_linears(*modules: nn.Module):
    """Within the block, every nn.Linear under `modules` uses `small_mm` for at most SMALL_ROWS rows."""
    patched = []
    for m in modules:
        for lin in (x for x in m.modules() if type(x) is nn.Linear):
            lin.forward = types.MethodType(_small_batch_linear, lin)
            patched.append(lin)
    try:
        yield
    finally:
        for lin in patched:
            del lin.forward  # back to the class's forward


def _crop_to(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


# ---------------------------------------------------------------------------------------------------
# drafters: what the heads contribute at position p


class MedusaDrafter:
    """Parallel heads: every depth reads the backbone's h_p; all k projections in one matmul."""

    def __init__(self, heads, lm_head: nn.Module):
        self.heads, self.k = heads, heads.k
        self.weight = None if heads.lm_heads is not None else heads.draft_weight(lm_head).detach().contiguous()

    def reset(self) -> None:
        pass

    def draft(self, tokens: torch.Tensor, hidden: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (N,) committed, hidden (N - 1, d) backbone states -> n draft tokens (n,) and their
        top-1 probabilities (n,)."""
        h = hidden[-1]  # (d,)
        hh = torch.stack([blk(h) for blk in self.heads.blocks[:n]])  # (n, d)
        if self.weight is not None:
            logits = small_mm(hh, self.weight)  # (n, |D|) one matmul for all depths
        else:
            logits = torch.stack([self.heads.lm_heads[j](hh[j]) for j in range(n)])
        prob, idx = torch.softmax(logits.float(), -1).max(-1)  # (n,), (n,)
        return self.heads.to_tokens(idx), prob

    def commit(self, n_before: int, kept: int) -> None:
        pass


class ChainedDrafter:
    """Chained MTP modules with one KV cache each (see the module docstring for what stays valid)."""

    def __init__(self, heads, lm_head: nn.Module, embed: nn.Module):
        from transformers import DynamicCache

        self.heads, self.k, self.embed = heads, heads.k, embed
        self.weight = heads.draft_weight(lm_head).detach().contiguous()  # (|D|, d)
        self._cache_cls = DynamicCache
        self.reset()

    def reset(self) -> None:
        self.caches = [self._cache_cls() for _ in range(self.k)]
        self.states: list[torch.Tensor | None] = [None] * self.k  # module j's outputs, positions 0..

    def draft(self, tokens: torch.Tensor, hidden: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = len(tokens) - 2  # the last position with a backbone state
        seq = tokens
        probs = []
        prev = hidden  # (p + 1, d): depth j - 1's states at positions 0..p
        for j in range(1, n + 1):
            start = self.caches[j - 1].get_seq_length()  # positions < start are cached and exact
            tok = seq[start + j: p + 1 + j]  # (m,) the tokens j ahead of positions start..p
            out = self.heads.module_step(j, prev[start: p + 1][None], self.embed(tok)[None],
                                         cache=self.caches[j - 1])[0]  # (m, d)
            old = self.states[j - 1]
            self.states[j - 1] = out if old is None or start == 0 else torch.cat([old[:start], out])
            prob, idx = torch.softmax(small_mm(out[-1:], self.weight)[0].float(), -1).max(-1)
            seq = torch.cat([seq, self.heads.to_tokens(idx)[None]])
            probs.append(prob)
            prev = self.states[j - 1]
        return seq[len(tokens):], torch.stack(probs) if probs else torch.zeros(0)

    def commit(self, n_before: int, kept: int) -> None:
        """`n_before` committed tokens before the step, `kept` drafts kept: crop what read a rejected draft."""
        for j in range(1, self.k + 1):
            valid = max(0, n_before + kept - j)  # positions 0 .. n_before - 1 + kept - j
            _crop_to(self.caches[j - 1], valid)
            if self.states[j - 1] is not None:
                self.states[j - 1] = self.states[j - 1][:valid]


def make_drafter(heads, backbone):
    if heads is None:
        return None
    if hasattr(heads, "module_step"):
        return ChainedDrafter(heads, backbone.lm_head, backbone.embed_tokens)
    return MedusaDrafter(heads, backbone.lm_head)


# ---------------------------------------------------------------------------------------------------
# depth policies for adaptive mode


class CostPolicy:
    """Pick n maximising E[committed tokens] / cost(n): E = 1 + sum_{j<=n} prod_{i<=j} a_i with
    a_i the running acceptance of depth i given depth i-1 accepted (Beta(1, 1) prior), cost(n) the
    measured time of a step with n drafts relative to n = 0."""

    def __init__(self, k: int, cost: list[float]):
        self.k, self.cost = k, cost
        self.acc, self.seen = [0] * k, [0] * k

    def choose(self, **_) -> int:
        best, best_n, chain, value = -1.0, 0, 1.0, 1.0
        for n in range(self.k + 1):
            if n > 0:
                chain *= (self.acc[n - 1] + 1) / (self.seen[n - 1] + 2)
                value += chain
            rate = value / self.cost[n]
            if rate > best:
                best, best_n = rate, n
        return best_n

    def update(self, n: int, kept: int, **_) -> None:
        for j in range(min(n, kept + 1)):  # depths the chain reached
            self.seen[j] += 1
            self.acc[j] += int(j < kept)


class EntropyPolicy:
    """EntMTP-style: n = k when the backbone's running entropy is at or below `low` nats, 0 at or
    above `high`, linear in between; the running estimate is an EMA over steps."""

    def __init__(self, k: int, low: float = 0.5, high: float = 3.0, decay: float = 0.5):
        self.k, self.low, self.high, self.decay = k, low, high, decay
        self.h = low

    def choose(self, **_) -> int:
        frac = (self.high - self.h) / max(self.high - self.low, 1e-6)
        return int(round(self.k * min(1.0, max(0.0, frac))))

    def update(self, n: int, kept: int, entropy: float = 0.0, **_) -> None:
        self.h = self.decay * self.h + (1 - self.decay) * entropy


# ---------------------------------------------------------------------------------------------------
# the decoder


class Decoder:
    """Decode one prompt at a time with a frozen backbone (a `backbone.Backbone`) and optional heads."""

    def __init__(self, backbone, heads=None, eos_ids: list[int] | None = None, drafter=None):
        """`drafter` replaces the heads' own (anything with k, reset, draft and commit; tests)."""
        self.backbone = backbone
        self.base = backbone.model.base_model  # transformer without the LM head
        self.weight = backbone.lm_head.weight.detach()  # (V, d)
        self.heads = heads
        self.drafter = drafter if drafter is not None else make_drafter(heads, backbone)
        self.k = self.drafter.k if self.drafter is not None else 0
        tok = backbone.tokenizer
        self.eos = set(eos_ids if eos_ids is not None else [tok.eos_token_id])
        self.device = backbone.device

    def _forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """(n,) tokens after the cached ones -> backbone states (n, d); the cache grows by n."""
        return self.base(input_ids=ids[None], cache=cache, use_cache=True).last_hidden_state[0]

    def _fast(self):
        return small_batch_linears(*(m for m in (self.backbone.model, self.heads) if m is not None))

    def generate(self, prompt: list[int], max_new_tokens: int, mode: str = "greedy", **opts) -> DecodeResult:
        """Decode `prompt` (token ids) for at most max_new_tokens new tokens; see `_generate`."""
        with self._fast(), torch.inference_mode():
            return self._generate(prompt, max_new_tokens, mode, **opts)

    def _generate(self, prompt: list[int], max_new_tokens: int, mode: str = "greedy", *,
                 span_policy=None, delta: float = 0.5, budget: float = 0.0, depth_policy=None,
                 trace: bool = False, record: bool = False) -> DecodeResult:
        """Decode `prompt` (token ids) for at most max_new_tokens new tokens.

        span_policy (clp, clp+verify): callable(hidden (d,), head_probs (k,) or None) -> m in 0..k,
            the drafts to keep (clp) or to verify (clp+verify); with `needs_probs = False` it is
            asked before drafting, with head_probs None.
        delta, budget (relaxed): see the module docstring; budget=0 is exact greedy verification.
        depth_policy (adaptive): a CostPolicy or EntropyPolicy (or anything with choose/update).
        """
        from transformers import DynamicCache

        if mode not in MODES:
            raise ValueError(f"unknown decoding mode {mode!r}; expected one of {', '.join(MODES)}")
        if mode != "greedy" and self.drafter is None:
            raise ValueError(f"mode {mode!r} needs heads")
        if mode in ("clp", "clp+verify") and span_policy is None:
            raise ValueError(f"mode {mode!r} needs a span_policy")
        early = mode in ("clp", "clp+verify") and not getattr(span_policy, "needs_probs", True)
        if mode == "adaptive" and depth_policy is None:
            raise ValueError("mode 'adaptive' needs a depth_policy")
        k = self.k
        res = DecodeResult(tokens=[], reached=[0] * k, accepted=[0] * k, trace=[] if trace else None,
                           records=[] if record else None)
        if self.drafter is not None:
            self.drafter.reset()
        cache = DynamicCache()
        t0 = time.perf_counter()
        ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device)
        hidden = self._forward(ids, cache)  # (P, d)
        first = int(small_mm(hidden[-1:], self.weight)[0].argmax())
        res.prefill_s = time.perf_counter() - t0
        tokens = torch.cat([ids, torch.tensor([first], device=self.device)])  # committed, (N,)
        new = [first]
        t1 = time.perf_counter()
        while not self._done(new, max_new_tokens):
            n_before = len(tokens)
            # 1. how many heads to run, then draft
            n = k
            if mode == "greedy":
                n = 0
            elif mode == "adaptive":
                n = depth_policy.choose()
            n = min(n, max_new_tokens - len(new) - 1)  # no draft past the token budget
            if early:  # the policy reads h_p only: run just the heads whose drafts it will use
                n = min(int(span_policy(hidden[-1], None)), n)
            drafts, probs = (self.drafter.draft(tokens, hidden, n) if n > 0
                             else (tokens.new_zeros(0), torch.zeros(0)))
            if mode in ("clp", "clp+verify") and not early and n > 0:
                m = min(int(span_policy(hidden[-1], probs)), n)
                drafts, n = drafts[:m], m
            # 2. one backbone forward over [x, d_1..d_n]
            out = self._forward(torch.cat([tokens[-1:], drafts]), cache)  # (n + 1, d)
            logits = small_mm(out, self.weight)  # (n + 1, V)
            greedy = logits.argmax(-1)  # (n + 1,)
            # 3. how many drafts to keep
            if mode in ("clp", "greedy"):
                kept = n
            elif mode == "relaxed":
                kept = self._relaxed(logits[:n], drafts, delta, budget)
            else:
                match = (drafts == greedy[:n]).long()  # (n,)
                kept = int(match.cumprod(0).sum())
            for j in range(min(n, kept + 1)):
                res.reached[j] += 1
                res.accepted[j] += int(j < kept)
            if kept < n:
                _crop_to(cache, n_before + kept)  # drop the rejected drafts' entries
            committed = torch.cat([drafts[:kept], greedy[kept: kept + 1]])
            hidden = torch.cat([hidden, out[: kept + 1]])  # states of x, d_1..d_kept
            tokens = torch.cat([tokens, committed])
            if self.drafter is not None:
                self.drafter.commit(n_before, kept)
            if trace:
                res.trace.append((n_before - 2, drafts.tolist(), kept))
            if record and n == k:
                res.records.append((hidden[n_before - 2].clone(), probs.clone(), kept))
            if mode == "adaptive":
                lp = torch.log_softmax(logits[kept].float(), -1)
                depth_policy.update(n, kept, entropy=float(-(lp.exp() * lp).sum()))
            res.steps += 1
            res.drafted.append(n)
            res.accept_lengths.append(kept + 1)
            new.extend(committed.tolist())
        res.decode_s = time.perf_counter() - t1
        res.cache_length = cache.get_seq_length()
        res.tokens, res.stopped = self._truncate(new, max_new_tokens)
        return res

    def _done(self, new: list[int], max_new_tokens: int) -> bool:
        return len(new) >= max_new_tokens or any(t in self.eos for t in new)

    def _truncate(self, new: list[int], max_new_tokens: int) -> tuple[list[int], str]:
        for i, t in enumerate(new[:max_new_tokens]):
            if t in self.eos:
                return new[: i + 1], "eos"
        return new[:max_new_tokens], "length"

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

    def step_costs(self, context: int = 128, reps: int = 5) -> list[float]:
        """Wall time of one backbone forward over n + 1 new tokens (n = 0..k) after `context` cached
        tokens, relative to n = 0: the verify cost curve of this machine, measured now."""
        with self._fast(), torch.inference_mode():
            return self._step_costs(context, reps)

    def _step_costs(self, context: int, reps: int) -> list[float]:
        from transformers import DynamicCache

        ids = torch.randint(0, self.weight.shape[0], (context + self.k + 1,), device=self.device,
                            generator=torch.Generator().manual_seed(0))
        cache = DynamicCache()
        self._forward(ids[:context], cache)
        times = []
        for n in range(self.k + 1):
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                out = self._forward(ids[context: context + n + 1], cache)
                small_mm(out, self.weight).argmax(-1)
                best = min(best, time.perf_counter() - t0)
                _crop_to(cache, context)
            times.append(best)
        return [t / times[0] for t in times]
