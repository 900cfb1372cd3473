"""The head-family and decoding-mode registries: every record resolves, and the places that read
them (config validation, the decoder, the export, the runner) follow the record, not a name."""

from __future__ import annotations

import re

import pytest
import torch

from mtp_train.config import EvalConfig, HeadsConfig
from mtp_train.decoding.acceptance import ExactMatch, Relaxed, Unverified
from mtp_train.decoding.drafters import family_of, make_drafter
from mtp_train.decoding.plans import Adaptive, Chain, NoDrafts, Span, Tree
from mtp_train.errors import ConfigError
from mtp_train.evaluation.decode import mode_parts
from mtp_train.evaluation.modes import EVAL_MODES, MODES
from mtp_train.heads.base import DraftHeads
from mtp_train.heads.persist import build_heads
from mtp_train.heads.registry import EXPORT_FORMATS, FAMILIES
from mtp_train.pipeline.serving import format_refusal
from mtp_train.trees import TreeShape


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_builds_its_heads_and_the_decoder_picks_its_drafter(tiny_backbone, name):
    fam = FAMILIES[name]
    heads = build_heads(HeadsConfig(type=name, k=2), tiny_backbone)
    assert isinstance(heads, fam.heads_class()) and isinstance(heads, DraftHeads)
    assert family_of(heads) == name
    drafter = make_drafter(heads, tiny_backbone, None)
    assert type(drafter) is fam.drafter_class() and drafter.k == 2
    assert type(drafter).__module__ == f"mtp_train.decoding.drafters.{name}"  # one drafter module per family
    assert bool(heads.aux_layers) == fam.reads_aux  # what the cache and the decoder ask of the heads
    w = heads.lm_weight(tiny_backbone.lm_head, 1)
    assert w.shape == (heads.draft_size, tiny_backbone.hidden_size)


def test_a_module_of_no_family_is_refused_by_name():
    with pytest.raises(TypeError, match="no registered head family"):
        family_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_accepts_exactly_the_settings_the_record_lists(name):
    fam = FAMILIES[name]
    all_inits = {i for f in FAMILIES.values() for i in f.inits}
    for init in sorted(all_inits):
        if init in fam.inits:
            HeadsConfig(type=name, init=init)
        else:
            with pytest.raises(ConfigError, match=rf"heads.init: '{init}' is not for {name} heads"):
                HeadsConfig(type=name, init=init)
    for lm in sorted({v for f in FAMILIES.values() for v in f.lm_heads} - set(fam.lm_heads)):
        with pytest.raises(ConfigError, match="heads.lm_head"):
            HeadsConfig(type=name, lm_head=lm)
    if not fam.shares_modules:
        with pytest.raises(ConfigError, match="heads.share"):
            HeadsConfig(type=name, share=True)
    if not fam.reads_aux:
        with pytest.raises(ConfigError, match="heads.aux_layers"):
            HeadsConfig(type=name, aux_layers=[1])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_exports_to_its_own_engine_format_only(name):
    fam = FAMILIES[name]
    for fmt in EXPORT_FORMATS[1:]:
        why = format_refusal(name, fmt)
        assert (why is None) == (fmt == fam.engine_format)
        if why is not None:
            assert f"heads={FAMILIES[name].name}" not in why and "train heads=" in why
    assert fam.engine_format is not None or fam.no_engine_format


@pytest.mark.parametrize("name", EVAL_MODES)
def test_each_mode_builds_the_parts_its_record_names(name):
    m = MODES[name]
    drafts, accept = mode_parts(name, tree=TreeShape.chain(2), span_policy=lambda h, p: 1,
                                depth_policy=object(), delta=0.3, budget=0.1)
    want = {"none": NoDrafts, "chain": Chain, "tree": Tree, "dynamic": Tree, "span": Span,
            "adaptive": Adaptive}[m.drafts]
    assert type(drafts) is want
    assert type(accept) is {"exact": ExactMatch, "relaxed": Relaxed, "unverified": Unverified}[m.acceptance]
    assert m.lossless == (type(accept) is ExactMatch)  # lossless modes verify exactly
    if m.drafts in ("tree", "dynamic", "span", "adaptive"):
        with pytest.raises(ValueError, match=re.escape(f"mode {name!r} needs")):
            mode_parts(name)


def test_eval_config_asks_for_the_predictor_each_mode_record_names(tmp_path):
    for name, m in MODES.items():
        if not m.decoder:
            continue
        cfg = EvalConfig(modes=[name], train_run=str(tmp_path))
        if m.predictor is None:
            cfg.check_inputs()
        else:
            with pytest.raises(ConfigError, match="eval.clp_run"):
                cfg.check_inputs()
    with pytest.raises(ConfigError, match="eval.modes"):
        EvalConfig(modes=["hf_generate"])  # the reference always runs; it is not a mode to ask for


def test_every_part_a_record_may_name_has_a_constructor():
    from mtp_train.evaluation.decode import PLANS, RULES
    from mtp_train.evaluation.modes import ACCEPTANCE, DRAFT_SOURCES, DecodingMode

    assert set(PLANS) == set(DRAFT_SOURCES) and set(RULES) == set(ACCEPTANCE)
    with pytest.raises(ValueError, match="drafts must be one of"):
        DecodingMode("beam", "a mode with a part nobody built", "beam", "exact", lossless=True)
