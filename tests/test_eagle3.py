"""EAGLE-3 heads: training-time test against a slow per-position reference, drafting in the decoder
(chain and tree) against the teacher-forced forward, lossless decoding, the cache's auxiliary states."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from mtp_train.config import HeadsConfig
from mtp_train.errors import ConfigError
from mtp_train.evaluation.decode import decode
from mtp_train.heads.eagle3 import default_aux_layers
from mtp_train.heads.persist import build_heads
from mtp_train.trees import TreeShape


@pytest.fixture(scope="module")
def backbone4():
    """A 4-layer tiny backbone: EAGLE-3's default layers need a few."""
    from mtp_train.backbone import load_backbone
    from mtp_train.config import BackboneConfig, TinyBackboneConfig

    return load_backbone(BackboneConfig(name="tiny4", source="tiny", tiny=TinyBackboneConfig(num_layers=4)))


def jittered(heads, seed=0):
    """Heads whose norms and lm_head are not at their initial values (a test that cannot tell a
    norm from none, or the frozen LM head from the backbone's, would pass otherwise)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in heads.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g) * (p.abs().mean() + 0.1))
    return heads.eval()


def reference_ttt(heads, aux, ids, embed):
    """One row, one position and one depth at a time, attention written out per head: depth j at
    position t reads emb(x_{t+j}) and the previous depth's output, at rotary position t + j - 1, and
    attends to the depth-1 keys of positions <= t and its own depths 2..j at t."""
    layer, a = heads.layer, heads.layer.self_attn
    T = ids.shape[1]
    emb = embed(ids)[0]
    g = heads.fuse(aux)[0]
    outs = torch.zeros(T, heads.k, heads.hidden_size)

    def qkv_one(e, h, pos):
        cos, sin = heads.rotary(h[None, None], torch.tensor([[pos]]))
        q, k, v, res = layer.qkv(e[None, None], h[None, None], cos, sin)
        return q[0, :, 0], k[0, :, 0], v[0, :, 0], res[0, 0]  # (H, hd), (Hkv, hd) x 2, (d,)

    depth1 = [qkv_one(emb[t + 1] if t + 1 < T else torch.zeros_like(emb[0]), g[t], t) for t in range(T)]
    groups = a.n_heads // a.n_kv
    for t in range(T):
        own_k, own_v, h = [], [], None
        for j in range(1, heads.k + 1):
            if j == 1:
                q, k, v, res = depth1[t]
            else:
                e = emb[t + j] if t + j < T else torch.zeros_like(emb[0])
                q, k, v, res = qkv_one(e, h, t + j - 1)
                own_k.append(k)
                own_v.append(v)
            heads_out = []
            for hh in range(a.n_heads):
                kv = hh // groups
                keys = [depth1[s][1][kv] for s in range(t + 1)] + [x[kv] for x in own_k]
                vals = [depth1[s][2][kv] for s in range(t + 1)] + [x[kv] for x in own_v]
                scores = torch.stack([q[hh] @ key for key in keys]) / math.sqrt(a.head_dim)
                w = torch.softmax(scores, 0)
                heads_out.append(sum(wi * vi for wi, vi in zip(w, vals, strict=True)))
            attn = torch.stack(heads_out)[None, :, None]  # (1, H, 1, hd)
            h = layer.finish(attn, res[None, None])[0, 0]
            outs[t, j - 1] = h
    return outs


def test_default_aux_layers_follow_eagle3_and_fit_small_backbones():
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layers(32) == [2, 16, 29]  # Llama-3.1-8B
    assert default_aux_layers(2) == [1]
    assert default_aux_layers(4) == [1, 2, 3]


def test_training_time_test_equals_the_per_position_reference(backbone4):
    torch.manual_seed(0)
    heads = jittered(build_heads(HeadsConfig(type="eagle3", k=3), backbone4))
    ids = torch.randint(0, 250, (1, 9))
    with torch.no_grad():
        hidden, aux = backbone4.hidden_and_aux(ids, None, heads.aux_layers)
        fast = heads(hidden, ids, backbone4.embed_tokens, aux=aux)[0]  # (T, k, d)
        slow = reference_ttt(heads, aux, ids, backbone4.embed_tokens)
    assert heads.aux_layers == [1, 2, 3]
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)


def test_padding_on_the_right_changes_no_real_position(backbone4):
    torch.manual_seed(1)
    heads = jittered(build_heads(HeadsConfig(type="eagle3", k=2), backbone4), seed=1)
    ids = torch.randint(0, 250, (2, 10))
    attn = torch.ones(2, 10, dtype=torch.long)
    attn[1, 6:] = 0
    with torch.no_grad():
        hidden, aux = backbone4.hidden_and_aux(ids, attn, heads.aux_layers)
        both = heads(hidden, ids, backbone4.embed_tokens, attn, aux=aux)
        alone = heads(hidden[1:, :6], ids[1:, :6], backbone4.embed_tokens, aux=aux[1:, :6])
    # depth j at t < 6 - j reads only tokens inside the row
    for j in range(2):
        torch.testing.assert_close(both[1, : 6 - 1 - j, j], alone[0, : 6 - 1 - j, j], rtol=1e-4, atol=1e-5)


def _teacher_forced_logprobs(heads, backbone, ids, p, path_tokens):
    """Log-probs (|D|,) of the depth len(path)+1 draft at position p, with the path's drafts in place
    of the tokens after x_{p+1}."""
    ids = ids.clone()
    ids[0, p + 2: p + 2 + len(path_tokens)] = torch.tensor(path_tokens)
    with torch.no_grad():
        hidden, aux = backbone.hidden_and_aux(ids[:, : p + 1], None, heads.aux_layers)
        out = heads(hidden, ids[:, : p + 1 + heads.k], backbone.embed_tokens,
                    aux=torch.cat([aux, aux.new_zeros(1, heads.k, aux.shape[-1])], 1))
        return torch.log_softmax(heads.project(out[0, p, len(path_tokens)], backbone.lm_head).float(), -1)


@pytest.mark.parametrize("shape", [TreeShape.chain(3), TreeShape.of([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0),
                                                                        (0, 1, 0)])])
def test_drafting_equals_the_teacher_forced_heads_on_every_path(backbone4, shape):
    """Each drafted node's cumulative log-probability is the teacher-forced one of its path: the
    decoder's KV cache, scratch rows, positions and tree mask reproduce training-time test."""
    from mtp_train.decoding import Decoder, draft_tree

    torch.manual_seed(2)
    heads = jittered(build_heads(HeadsConfig(type="eagle3", k=3, draft_vocab=60), backbone4,
                                 draft_ids=torch.arange(0, 240, 4)), seed=2)
    ids = torch.randint(0, 250, (1, 24))
    dec = Decoder(backbone4, heads, eos_ids=[10**6])
    p = 14
    with torch.inference_mode():
        hidden, aux = backbone4.hidden_and_aux(ids[:, : p + 1], None, heads.aux_layers)
        dec.drafter.reset()  # fill the cache with a first step at p - 3, then draft at p (incremental)
        draft_tree(dec.drafter, ids[0, : p - 1], hidden[0, : p - 2], TreeShape.chain(3), 3, aux[0, : p - 2])
        tree = draft_tree(dec.drafter, ids[0, : p + 2], hidden[0], shape, 3, aux[0])
    assert tree.n == shape.n
    for v in range(tree.n):
        path = tree.path_to(v)
        total = 0.0
        for i, u in enumerate(path):
            lp = _teacher_forced_logprobs(heads, backbone4, ids, p, [tree.tokens[a] for a in path[:i]])
            total += float(lp[heads.to_draft(torch.tensor(tree.tokens[u]))])
        assert tree.scores[v] == pytest.approx(total, abs=2e-4)


@pytest.mark.parametrize("tree", [None, "static", "dynamic"])
def test_decoding_with_eagle3_heads_is_lossless(backbone4, tree):
    from mtp_train.decoding import Decoder, DynamicTree

    torch.manual_seed(3)
    heads = jittered(build_heads(HeadsConfig(type="eagle3", k=3), backbone4), seed=3)
    shape = {None: None, "static": TreeShape.of([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]),
             "dynamic": DynamicTree(nodes=8, topk=3, width=2)}[tree]
    dec = Decoder(backbone4, heads, eos_ids=[10**6])
    prompt = torch.randint(0, 250, (12,)).tolist()
    greedy = decode(dec, prompt, 24, "greedy")
    got = decode(dec, prompt, 24, {None: "verify", "static": "tree", "dynamic": "dynamic"}[tree], tree=shape)
    assert got.tokens == greedy.tokens
    assert got.steps < 24 or shape is None  # trees over 3 candidates hit some on a random model


@pytest.mark.integration
def test_the_cache_stores_the_auxiliary_layers_and_training_from_it_matches_live(typed_cfg):
    from data_prep.stages import run_prep
    from mtp_train.backbone import load_backbone
    from mtp_train.data.cache import HiddenCache
    from mtp_train.data.prepared import cache_location
    from mtp_train.layout import data_dirs
    from mtp_train.lit.data import MTPDataModule, load_splits
    from mtp_train.lit.module import MTPHeadsModule
    from tests.test_cache import FAST

    cfg = typed_cfg(*FAST, "heads=eagle3", "heads.k=2")
    for stage in ("data", "distill", "cache"):
        run_prep(dataclasses.replace(cfg, stage=stage))
    backbone = load_backbone(cfg.backbone)
    key, path = cache_location(cfg, backbone)
    plain_key, _ = cache_location(typed_cfg(*FAST), backbone)
    assert key != plain_key  # the layer ids are part of the key
    cache = HiddenCache(path)
    assert cache.aux_layers == [1]
    # layers past the backbone's depth are refused by the cache stage as by mtp-train (prep wrote a
    # cache that training then refused, hostile round 3)
    deep = typed_cfg(*FAST, "heads=eagle3", "heads.k=2", "heads.aux_layers=[0,1,2]")
    with pytest.raises(ConfigError, match=r"heads\.aux_layers must be distinct layer ids in \[0, 1\] for a backbone with 2"):
        run_prep(dataclasses.replace(deep, stage="cache"))
    splits = load_splits(data_dirs(cfg))
    ids = torch.tensor([splits["train"][3]["input_ids"][:96]])
    with torch.no_grad():
        _, live = backbone.hidden_and_aux(ids, None, [1])
    np.testing.assert_allclose(cache.aux("train", 3).astype(np.float32), live[0].numpy(), rtol=2e-3, atol=2e-3)

    heads = build_heads(cfg.heads, backbone)
    module = MTPHeadsModule(backbone, heads, cfg.loss, cfg.train)
    out = {}
    for name, c in (("live", None), ("cache", cache)):
        dm = MTPDataModule(data_dirs(cfg), backbone.tokenizer.pad_token_id, 4, 96, cache=c)
        dm.setup()
        batch = next(iter(dm.val_dataloader()))
        assert ("aux" in batch) == (c is not None)
        with torch.no_grad():
            out[name] = module.model_step(batch, "val").item()
    assert out["cache"] == pytest.approx(out["live"], rel=1e-2, abs=1e-4)


@pytest.mark.integration
def test_eagle3_trains_saves_only_what_trains_and_reloads(typed_cfg, tmp_path):
    from safetensors.torch import load_file

    from mtp_train.heads.persist import load_heads
    from tests.helpers import run_train
    from tests.test_cache import FAST

    cfg = typed_cfg(*FAST, "heads=eagle3", "heads.k=2", "heads.draft_vocab=64", f"hydra.run.dir={tmp_path}/run",
                    f"paths.output_dir={tmp_path}/run")
    run_train(cfg)  # that heads of every family learn: test_train.py
    state = load_file(str(tmp_path / "run" / "heads.safetensors"))
    assert "lm_head.weight" not in state  # the frozen LM head is the backbone's rows: rebuilt on load
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight", "norm.weight",
            "draft_ids"} <= set(state)
    from mtp_train.backbone import load_backbone

    backbone = load_backbone(cfg.backbone)
    heads, meta = load_heads(tmp_path / "run", backbone)
    assert heads.aux_layers == [1] and heads.draft_size == len(state["draft_ids"])
    torch.testing.assert_close(heads.lm_weight(backbone.lm_head), backbone.lm_head.weight[state["draft_ids"]])
    torch.testing.assert_close(heads.fc.weight, state["fc.weight"])


def test_final_state_init_is_the_least_squares_map_to_the_final_state(backbone4):
    torch.manual_seed(4)
    heads = build_heads(HeadsConfig(type="eagle3", k=2, init="final_state"), backbone4)
    W = torch.randn(64, 3 * 64)
    aux = torch.randn(500, 3 * 64)
    final = aux @ W.T
    explained = heads.fit_to_final_state(aux, final, ridge=1e-9)
    assert explained == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(heads.fc.weight, W, rtol=1e-3, atol=1e-3)
    assert float(heads.norm.weight[0]) == pytest.approx(float(final.pow(2).mean(-1).sqrt().mean()), rel=1e-5)


@pytest.mark.integration
def test_final_state_init_trains_and_is_refused_for_other_families(typed_cfg, caplog):
    import logging
    import re

    from mtp_train.errors import ConfigError
    from tests.helpers import run_train
    from tests.test_cache import FAST

    with pytest.raises(ConfigError, match=r"heads.init: 'final_state' is not for chained heads.*random or copy_last"):
        typed_cfg(*FAST, "heads=chained", "heads.init=final_state")
    with caplog.at_level(logging.INFO):
        run_train(typed_cfg(*FAST, "heads=eagle3", "heads.k=2", "heads.init=final_state"))
    fitted = re.search(r"fc fitted on \d+ tokens; it explains ([\d.]+)% of the final state's variance", caplog.text)
    assert fitted and float(fitted.group(1)) > 90, caplog.text  # the auxiliary layers nearly give the final state


@pytest.mark.integration
def test_mtp_eval_decodes_with_eagle3_heads_losslessly_in_every_verifying_mode(typed_cfg, tmp_path):
    from mtp_train.pipeline.evaluation import run_eval
    from tests.helpers import run_train
    from tests.test_cache import FAST

    run_train(typed_cfg(*FAST, "heads=eagle3", "heads.k=2", f"paths.output_dir={tmp_path}/train"))
    report = run_eval(typed_cfg(*FAST, f"paths.output_dir={tmp_path}/eval", f"eval.train_run={tmp_path}/train",
                                "eval.n_prompts=2", "eval.max_new_tokens=10", "eval.rounds=1",
                                "eval.modes=[greedy,verify,tree,dynamic,adaptive]"))
    for mode in ("verify", "tree", "dynamic", "adaptive"):
        assert report["modes"][mode]["identical_to_greedy"] is True, mode


@pytest.mark.integration
def test_clp_labels_eagle3_heads_from_their_own_cache(typed_cfg, tmp_path):
    """mtp-clp composes heads=chained by default: the cache it reads is the one for the loaded heads'
    auxiliary layers, not the config's."""
    from data_prep.stages import run_prep
    from mtp_train.pipeline.clp_run import run_clp
    from tests.helpers import run_train
    from tests.test_cache import FAST

    cfg = typed_cfg(*FAST, "heads=eagle3", "heads.k=2", f"paths.output_dir={tmp_path}/train")
    run_train(cfg)
    run_prep(dataclasses.replace(cfg, stage="cache"))
    m = run_clp(typed_cfg(*FAST, "clp.label_source=cache", f"clp.train_run={tmp_path}/train", "stage=label",
                          f"paths.output_dir={tmp_path}/clp"))["label"]
    assert m["source"] == "cache" and m["rows"] > 0 and m["k"] == 2


def test_a_bf16_copy_keeps_float32_rotary_frequencies(backbone4):
    heads = build_heads(HeadsConfig(type="eagle3", k=2), backbone4)
    fp32 = heads.rotary_emb.inv_freq.clone()
    half = heads.to(torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(half.rotary_emb.inv_freq, fp32, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["tree", "adaptive"])
def test_every_step_of_a_decode_drafts_what_a_fresh_drafter_drafts(backbone4, mode):
    """The drafter's KV cache stays exact across steps: tree steps whose scratch rows are dropped,
    steps that commit several tokens, and (adaptive) steps that draft nothing, after which the
    committed rows catch up. Each step's tree equals one drafted from scratch on the same tokens."""
    from mtp_train.decoding import CostPolicy, Decoder, draft_tree

    torch.manual_seed(6)
    heads = jittered(build_heads(HeadsConfig(type="eagle3", k=3), backbone4), seed=6)
    shape = TreeShape.of([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    kw = {"tree": shape} if mode == "tree" else {
        "depth_policy": CostPolicy([TreeShape(()), TreeShape.chain(1), shape], [1.0, 1.3, 1.6], probe=3)}
    prompt = torch.randint(0, 250, (10,), generator=torch.Generator().manual_seed(6)).tolist()
    dec = Decoder(backbone4, heads, eos_ids=[10**6])
    res = decode(dec, prompt, 30, mode, trace=True, **kw)
    committed = prompt + res.tokens
    fresh = Decoder(backbone4, heads, eos_ids=[10**6])
    drafted = idle = 0
    for p, tokens, parents, _, ranks in res.trace:
        if not tokens:
            idle += 1
            continue
        ids = torch.tensor(committed[: p + 2])
        with torch.inference_mode():
            hidden, aux = backbone4.hidden_and_aux(ids[None, : p + 1], None, heads.aux_layers)
            fresh.drafter.reset()
            tree = draft_tree(fresh.drafter, ids, hidden[0], TreeShape.of(ranks), 3, aux[0])
        assert (tree.tokens, tree.parents) == (tokens, parents), p
        drafted += 1
    assert drafted >= 3 and (mode == "verify" or idle >= 1)


@pytest.mark.integration
def test_checkpoints_hold_only_what_trains_and_export_rebuilds_the_heads(typed_cfg, tmp_path):
    from mtp_train import layout
    from mtp_train.distributed import load_weights_only
    from mtp_train.pipeline.export import export_heads
    from tests.helpers import run_train
    from tests.test_cache import FAST

    run = tmp_path / "run"
    run_train(typed_cfg(*FAST, "heads=eagle3", "heads.k=2", "heads.draft_vocab=64", f"paths.output_dir={run}"))
    from safetensors.torch import load_file

    saved = load_file(str(run / "heads.safetensors"))
    ckpt = load_weights_only(layout.last_checkpoint(run))["state_dict"]
    assert not any("frozen_head" in n or "lm_head" in n for n in ckpt)  # the backbone's rows are not trained
    (run / "heads.safetensors").unlink()
    export_heads(run)
    again = load_file(str(run / "heads.safetensors"))
    assert set(again) == set(saved)
    for n in saved:
        torch.testing.assert_close(again[n], saved[n])
