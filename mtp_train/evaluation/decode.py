"""Decoding in a named mode: the decoder parts a mode's record (evaluation/modes.py) names, made
into the objects `Decoder.generate` takes; with `warpers`, the same mode under speculative
sampling (drafts drawn from the heads' warped distribution, verified by rejection sampling)."""

from __future__ import annotations

from mtp_train.decoding.acceptance import ExactMatch, RejectionSampling, Relaxed, Unverified
from mtp_train.decoding.plans import Adaptive, Chain, NoDrafts, Sampled, Span, Tree
from mtp_train.decoding.sampling import DraftSampler
from mtp_train.evaluation.modes import mode

# each kind of plan source and acceptance rule a record names, built from the run's options
PLANS = {"none": lambda o: NoDrafts(), "chain": lambda o: Chain(), "tree": lambda o: Tree(o["tree"]),
         "dynamic": lambda o: Tree(o["tree"]), "span": lambda o: Span(o["span_policy"]),
         "adaptive": lambda o: Adaptive(o["depth_policy"])}
RULES = {"exact": lambda o: ExactMatch(), "relaxed": lambda o: Relaxed(o["delta"], o["budget"]),
         "unverified": lambda o: Unverified()}
NEEDS = {"tree": "tree", "dynamic": "tree", "span": "span_policy", "adaptive": "depth_policy"}


def mode_parts(name: str, *, tree=None, span_policy=None, depth_policy=None, delta: float = 0.5,
               budget: float = 0.0, warpers=None, generator=None, vocab: int | None = None):
    """(plan source, acceptance rule) of mode `name`, from the options it reads: tree (tree,
    dynamic: a TreeShape / DynamicTree), span_policy (the predictor's policy), depth_policy
    (adaptive), delta and budget (relaxed); the others are ignored.

    warpers (sampling.Warpers): sample at that temperature instead, every draw from `generator`;
    `vocab` is the backbone's vocabulary size (for heads with a draft vocabulary). Relaxed becomes
    lenient rejection sampling with leniency delta (the budget is greedy-only)."""
    m = mode(name)
    if warpers is not None and m.cannot_sample:
        raise ValueError(f"mode {name!r} cannot sample: it {m.cannot_sample}")
    if not m.decoder:
        raise ValueError(f"{name} is not run by the decoder")
    options = {"tree": tree, "span_policy": span_policy, "depth_policy": depth_policy, "delta": delta,
               "budget": budget}
    if m.drafts in NEEDS and options[NEEDS[m.drafts]] is None:
        raise ValueError(f"mode {name!r} needs {NEEDS[m.drafts]}=")
    drafts = PLANS[m.drafts](options)
    if warpers is None:
        return drafts, RULES[m.acceptance](options)
    rule = RejectionSampling(warpers, generator, leniency=delta if m.acceptance == "relaxed" else 1.0)
    return Sampled(drafts, DraftSampler(warpers, generator, vocab)), rule


def decode(decoder, prompt: list[int], max_new_tokens: int, name: str = "greedy", *, trace: bool = False,
           record: bool = False, **options):
    """Decode `prompt` with `decoder` in mode `name` (options: `mode_parts`)."""
    drafts, accept = mode_parts(name, **options)
    return decoder.generate(prompt, max_new_tokens, drafts, accept, trace=trace, record=record)
