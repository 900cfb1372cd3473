"""Decoding in a named mode: the decoder parts a mode's record (evaluation/modes.py) names, made
into the objects `Decoder.generate` takes."""

from __future__ import annotations

from mtp_train.decoding.acceptance import ExactMatch, Relaxed, Unverified
from mtp_train.decoding.plans import Adaptive, Chain, NoDrafts, Span, Tree
from mtp_train.evaluation.modes import mode

# each kind of plan source and acceptance rule a record names, built from the run's options
PLANS = {"none": lambda o: NoDrafts(), "chain": lambda o: Chain(), "tree": lambda o: Tree(o["tree"]),
         "dynamic": lambda o: Tree(o["tree"]), "span": lambda o: Span(o["span_policy"]),
         "adaptive": lambda o: Adaptive(o["depth_policy"])}
RULES = {"exact": lambda o: ExactMatch(), "relaxed": lambda o: Relaxed(o["delta"], o["budget"]),
         "unverified": lambda o: Unverified()}
NEEDS = {"tree": "tree", "dynamic": "tree", "span": "span_policy", "adaptive": "depth_policy"}


def mode_parts(name: str, *, tree=None, span_policy=None, depth_policy=None, delta: float = 0.5,
               budget: float = 0.0):
    """(plan source, acceptance rule) of mode `name`, from the options it reads: tree (tree,
    dynamic: a TreeShape / DynamicTree), span_policy (the predictor's policy), depth_policy
    (adaptive), delta and budget (relaxed); the others are ignored."""
    m = mode(name)
    if not m.decoder:
        raise ValueError(f"{name} is not run by the decoder")
    options = {"tree": tree, "span_policy": span_policy, "depth_policy": depth_policy, "delta": delta,
               "budget": budget}
    if m.drafts in NEEDS and options[NEEDS[m.drafts]] is None:
        raise ValueError(f"mode {name!r} needs {NEEDS[m.drafts]}=")
    return PLANS[m.drafts](options), RULES[m.acceptance](options)


def decode(decoder, prompt: list[int], max_new_tokens: int, name: str = "greedy", *, trace: bool = False,
           record: bool = False, **options):
    """Decode `prompt` with `decoder` in mode `name` (options: `mode_parts`)."""
    drafts, accept = mode_parts(name, **options)
    return decoder.generate(prompt, max_new_tokens, drafts, accept, trace=trace, record=record)
