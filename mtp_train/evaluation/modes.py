"""The decoding modes mtp-eval measures (`eval.modes`), one record each, and HF `generate`, the
reference every mode is timed against.

A record says which parts of the decoder the mode uses (where a step's drafts come from, which
acceptance rule keeps them: evaluation/decode.py makes the objects), whether its output must equal
greedy decoding's (lossless), which span predictor it needs (`mtp-clp`'s kinds) and whether it
needs the validation's tree statistics. Config validation, the runner, the report and the docs read
these records; the decoder itself knows no mode names. The records import nothing, so the config
schema can read them. Adding a mode means one record here; a new kind of plan or acceptance rule
also needs its class in mtp_train/decoding/, its name in DRAFT_SOURCES / ACCEPTANCE below and its
constructor in evaluation/decode.py's PLANS / RULES.
"""

from __future__ import annotations

from dataclasses import dataclass

DRAFT_SOURCES = ("none", "chain", "tree", "dynamic", "span", "adaptive")
ACCEPTANCE = ("exact", "relaxed", "unverified")


@dataclass(frozen=True)
class DecodingMode:
    name: str
    what: str  # one line: what the mode does
    drafts: str  # where a step's drafts come from (DRAFT_SOURCES)
    acceptance: str  # which rule keeps them (ACCEPTANCE)
    lossless: bool  # its output must equal greedy decoding's
    predictor: str | None = None  # the mtp-clp predictor kind it needs (clp.kinds), if any
    tree_stats: bool = False  # it needs the validation's rank statistics (tree_stats.json) to plan its tree
    decoder: bool = True  # run by our decoder (False: HF generate, the reference)
    # why the mode cannot run under speculative sampling (eval.sampling), or None when it can
    cannot_sample: str | None = None

    def __post_init__(self) -> None:
        if self.drafts not in DRAFT_SOURCES or self.acceptance not in ACCEPTANCE:
            raise ValueError(f"mode {self.name!r}: drafts must be one of {DRAFT_SOURCES} and acceptance one "
                             f"of {ACCEPTANCE}, got {self.drafts!r}, {self.acceptance!r}")


UNVERIFIED = "commits drafts unverified: under sampling it would emit the heads' distribution, not the backbone's, and its predictor's labels are greedy acceptances, which say nothing about sampled ones (docs/decoding.md)"

MODES: dict[str, DecodingMode] = {m.name: m for m in (
    DecodingMode("hf_generate", "HF generate, greedy: the reference every mode is timed against",
                 "none", "exact", lossless=True, decoder=False),
    DecodingMode("greedy", "our own one-token loop (the decoder's reference)", "none", "exact", lossless=True),
    DecodingMode("verify", "lossless verification of a chain of k drafts", "chain", "exact", lossless=True),
    DecodingMode("tree", "lossless verification of a static token tree planned from the validation's "
                 "rank statistics", "tree", "exact", lossless=True, tree_stats=True),
    DecodingMode("dynamic", "lossless verification of an EAGLE-2-style dynamic tree", "dynamic", "exact",
                 lossless=True),
    DecodingMode("relaxed", "keep chain drafts within a probability ratio and drift budget of the "
                 "backbone's choice", "chain", "relaxed", lossless=False),
    DecodingMode("clp", "CLP picks how many drafts to commit unverified", "span", "unverified",
                 lossless=False, predictor="clp", cannot_sample=UNVERIFIED),
    DecodingMode("gate", "the gate-network baseline picks how many drafts to commit unverified", "span",
                 "unverified", lossless=False, predictor="gate", cannot_sample=UNVERIFIED),
    DecodingMode("clp+verify", "CLP's span caps how many drafts are verified (lossless)", "span", "exact",
                 lossless=True, predictor="clp"),
    DecodingMode("adaptive", "lossless verification of the tree a depth policy picks per step", "adaptive",
                 "exact", lossless=True),
)}

EVAL_MODES = tuple(n for n, m in MODES.items() if m.decoder)  # what eval.modes may list
SAMPLING_MODES = tuple(n for n in EVAL_MODES if MODES[n].cannot_sample is None)  # what eval.sampling.modes may list


def mode(name: str) -> DecodingMode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown decoding mode {name!r}; expected one of {', '.join(EVAL_MODES)}") from None

