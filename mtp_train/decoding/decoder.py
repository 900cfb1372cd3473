"""The bundled decoder: batch-size-1, KV-cached, "the backbone makes the next token, the heads draft
the ones after it" (Backbone-as-Architect). Plain torch + transformers; no Lightning, no Hydra.

One step, with x the last committed token (made by the backbone, not yet fed to it) and p the
position of the last backbone hidden state:

    1. plan    what to draft: the plan source passed in (plans.py: nothing, a chain, a static or
               dynamic tree, a span policy's m, an adaptive policy's tree)
    2. draft   the heads draft a tree of nodes under x, level by level (`drafting.draft_tree`; a
               chain is the one-branch tree)
    3. verify  the backbone reads [x, nodes] in one forward: each node attends to the cached prefix,
               x and its own ancestors, at position N - 1 + depth (`_verify`; a chain is a plain
               causal forward)
    4. accept  the acceptance rule passed in (acceptance.py) picks the path to keep (and, when it
               samples, the token after it)
    5. commit  the kept path plus the backbone's token after it are committed; the KV rows of the
               kept path are compacted into place (every layer), so the cache equals what sequential
               greedy decoding would hold (`_commit`)

What each of mtp-eval's modes passes in is its record in evaluation/modes.py (docs/decoding.md).
Chained MTP modules keep one KV cache each holding only rows whose inputs are committed; tree rows
are scratch and are cropped after the step (drafters/chained.py). Stopping is HF `generate`'s: after
max_new_tokens, or on an end-of-sequence token, which is kept.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from mtp_train.backbone import cut_at_eos
from mtp_train.decoding.acceptance import ExactMatch, Kept
from mtp_train.decoding.drafters import make_drafter
from mtp_train.decoding.drafting import draft_tree
from mtp_train.decoding.kv import crop_to, keep_rows
from mtp_train.decoding.matmul import MatmulPlan, routed_linears
from mtp_train.decoding.plans import NoDrafts
from mtp_train.trees import DraftTree, tree_attention_mask


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
                 matmul: MatmulPlan | None = None, draft_past_budget: bool = False):
        """`drafter` replaces the heads' own (tests); `matmul` routes small-batch linears (None: each
        Decoder measures its own plan on first use); `draft_past_budget`: every step drafts all k
        heads, near max_new_tokens too, as vLLM does (mtp-serve-check counts as the engine counts)."""
        self.draft_past_budget = draft_past_budget
        self.backbone = backbone
        self.base = backbone.model.base_model  # transformer without the LM head
        self.weight = backbone.lm_head.weight.detach()  # (V, d)
        self.heads = self.draft_heads = heads
        self.aux_layers = list(heads.aux_layers) if heads is not None else []  # backbone layers the heads read
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

    def set_draft_dtype(self, dtype: torch.dtype) -> None:
        """Draft with a copy of the heads in `dtype`. Drafts need not be exact (verification is), so
        the heads may draft in a cheaper dtype than the backbone verifies in (mtp-eval times both and
        keeps the faster: docs/decoding.md)."""
        if self.heads is None or next(self.draft_heads.parameters()).dtype == dtype:
            return
        same = next(self.heads.parameters()).dtype == dtype
        self.draft_heads = self.heads if same else copy.deepcopy(self.heads).to(dtype)
        self.drafter = make_drafter(self.draft_heads, self.backbone, self.mm)

    @property
    def draft_dtype(self) -> torch.dtype | None:
        return None if self.draft_heads is None else next(self.draft_heads.parameters()).dtype

    def routing(self):
        """Within the block, the backbone's and the drafting heads' linears multiply through `mm`."""
        return routed_linears(self.mm, *(m for m in (self.backbone.model, self.draft_heads) if m is not None))

    def forward(self, ids: torch.Tensor, cache, **kw) -> torch.Tensor:
        """(n,) tokens after the cached ones -> backbone states (n, d); the cache grows by n."""
        return self.base(input_ids=ids[None], cache=cache, use_cache=True, **kw).last_hidden_state[0]

    def forward_aux(self, ids: torch.Tensor, cache, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `forward`, plus the inputs of the heads' auxiliary layers (n, n_aux * d) (or None)."""
        if not self.aux_layers:
            return self.forward(ids, cache, **kw), None
        hidden, aux = self.backbone.hidden_and_aux(ids[None], aux_layers=self.aux_layers, cache=cache,
                                                   use_cache=True, **kw)
        return hidden[0], aux[0]

    def generate(self, prompt: list[int], max_new_tokens: int, drafts=None, accept=None, *,
                 trace: bool = False, record: bool = False) -> DecodeResult:
        """Decode `prompt` (token ids) for at most max_new_tokens new tokens.

        drafts: where each step's drafts come from (a plans.py source; None = NoDrafts, greedy).
        accept: the acceptance rule (an acceptance.py rule; None = ExactMatch, lossless).
        trace, record: see DecodeResult.
        """
        drafts = NoDrafts() if drafts is None else drafts
        accept = ExactMatch() if accept is None else accept
        if drafts.drafts and self.drafter is None:
            raise ValueError(f"drafting ({type(drafts).__name__}) needs heads; this decoder has none")
        with self.routing(), torch.inference_mode():
            return self._generate(prompt, max_new_tokens, drafts, accept, trace, record)

    def _generate(self, prompt, max_new_tokens, drafts, accept, trace, record) -> DecodeResult:
        from transformers import DynamicCache

        k = self.k
        res = DecodeResult(tokens=[], reached=[0] * k, accepted=[0] * k, trace=[] if trace else None,
                           records=[] if record else None)
        if self.drafter is not None:
            self.drafter.reset()
        t0 = time.perf_counter()
        cache = DynamicCache()
        ids = torch.as_tensor(prompt, dtype=torch.long, device=self.device)
        hidden, aux = self.forward_aux(ids, cache)  # (P, d), (P, n * d) or None
        logits = self.mm.mm(hidden[-1:], self.weight)
        first = accept.next_token(logits[0])
        st = _State(tokens=torch.cat([ids, torch.tensor([first], device=self.device)]), hidden=hidden,
                    cache=cache, new=[first], entropy=entropy(logits[0]), aux=aux)
        res.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        while not self._done(st.new, max_new_tokens):
            # no draft past the token budget, unless drafting as vLLM does (it drafts the full chain
            # up to the last step and counts what is accepted past max_tokens): mtp-serve-check
            room = k if self.draft_past_budget else max_new_tokens - len(st.new) - 1
            plan = drafts.plan(k, st)
            d = (draft_tree(self.drafter, st.tokens, st.hidden, plan, room, st.aux, drafts.sampler)
                 if self.drafter else DraftTree())
            d = drafts.cut(d, st)
            out, logits, aux = self._verify(st, d)
            path = accept.accept(d, logits)
            n_before = len(st.tokens)
            self._commit(st, d, path, out, logits, aux, accept)
            self._record(res, st, d, path, plan, n_before, drafts, trace, record)
        res.decode_s = time.perf_counter() - t1
        res.cache_length = st.cache.get_seq_length()
        res.tokens, res.stopped = cut_at_eos(st.new, self.eos, max_new_tokens)
        return res

    # --- the step, in parts -----------------------------------------------------------------------

    def _verify(self, st: _State, d: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One backbone forward over [x, nodes] -> states (n + 1, d), logits (n + 1, V) and the
        auxiliary layers' states (n + 1, n_aux * d) or None."""
        ids = torch.cat([st.tokens[-1:], torch.tensor(d.tokens, dtype=torch.long, device=self.device)])
        if d.is_chain():
            out, aux = self.forward_aux(ids, st.cache)
        else:
            cached = st.cache.get_seq_length()
            pos = torch.tensor([cached] + [cached + x for x in d.depths], device=self.device)[None]
            mask = tree_attention_mask(d.parents, cached, st.hidden.dtype, self.device)
            out, aux = self.forward_aux(ids, st.cache, attention_mask=mask, position_ids=pos)
        return out, self.mm.mm(out, self.weight), aux

    def _commit(self, st: _State, d: DraftTree, path: list[int], out: torch.Tensor, logits: torch.Tensor,
                aux: torch.Tensor | None, accept) -> None:
        """Commit the path and the backbone's token after it; keep the path's KV rows and states."""
        rows = [0] + [1 + v for v in path]  # rows of [x, nodes] to keep
        cached = st.cache.get_seq_length() - (d.n + 1)
        if rows == list(range(len(rows))):
            crop_to(st.cache, cached + len(rows))
        else:
            keep_rows(st.cache, torch.cat([torch.arange(cached), cached + torch.tensor(rows)]).to(self.device))
        last = rows[-1]
        bonus = path.token if isinstance(path, Kept) else accept.next_token(logits[last])
        committed = [d.tokens[v] for v in path] + [bonus]
        st.hidden = torch.cat([st.hidden, out[rows]])
        if aux is not None:
            st.aux = torch.cat([st.aux, aux[rows]])
        st.tokens = torch.cat([st.tokens, torch.tensor(committed, dtype=torch.long, device=self.device)])
        st.new.extend(committed)
        st.entropy = entropy(logits[last])

    def _record(self, res: DecodeResult, st: _State, d: DraftTree, path, plan, n_before, drafts,
                trace, record) -> None:
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
        drafts.update(plan, d.ranks[path[-1]] if path and d.ranks else (), st.entropy)
        res.steps += 1
        res.drafted.append(d.n)
        res.accept_lengths.append(kept + 1)

    def _done(self, new: list[int], max_new_tokens: int) -> bool:
        return len(new) >= max_new_tokens or any(t in self.eos for t in new)


def entropy(logits: torch.Tensor) -> float:
    """Of softmax(logits), in nats."""
    lp = torch.log_softmax(logits.float(), -1)
    return float(-(lp.exp() * lp).sum())
