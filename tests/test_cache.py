"""Hidden-state cache: what it stores, that training from it matches the live backbone, keying."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from data_prep import cache as cache_mod
from data_prep.stages import run_prep
from mtp_train.data.prepared import cache_location
from mtp_train.layout import data_dirs

FAST = ["debug=smoke", "data.distill.max_train_prompts=24", "data.distill.max_val_prompts=8",
        "train.max_length=96"]


@pytest.fixture
def cached(typed_cfg):
    cfg = typed_cfg(*FAST)
    for stage in ("data", "distill", "cache"):
        run_prep(dataclasses.replace(cfg, stage=stage))
    from mtp_train.backbone import load_backbone

    backbone = load_backbone(cfg.backbone)
    key, path = cache_location(cfg, backbone)
    return cfg, backbone, path


@pytest.mark.integration
def test_cache_holds_the_backbones_hidden_states(cached):
    from mtp_train.data.prepared import load_splits

    cfg, backbone, path = cached
    cache = cache_mod.HiddenCache(path)
    m = cache.manifest
    splits = load_splits(data_dirs(cfg))
    assert m["rows"] == {"train": 24, "validation": 8}
    assert m["tokens"] == sum(min(96, len(r)) for s in splits.values() for r in s["input_ids"])
    # float16 x d, float32 lse + entropy, int32 greedy token, plus small offsets and headers
    assert abs(m["bytes_per_token"] - (64 * 2 + 12)) < 8
    for split, i in (("train", 0), ("train", 23), ("validation", 5)):
        ids = torch.tensor([splits[split][i]["input_ids"][:96]])
        with torch.no_grad():
            live = backbone.hidden_states(ids)[0]
            logp = torch.log_softmax(backbone.logits(live).double(), -1)  # (T, V) slow reference
        stored = cache.row(split, i)
        assert stored.dtype == np.float16 and stored.shape == live.shape
        np.testing.assert_allclose(stored.astype(np.float32), live.numpy(), rtol=2e-3, atol=2e-3)
        st = cache.stats(split, i)
        lse = torch.logsumexp(backbone.logits(live).double(), -1)
        np.testing.assert_allclose(st["lse"], lse.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(st["entropy"], -(logp.exp() * logp).sum(-1).numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(st["top"], logp.argmax(-1).numpy())


@pytest.mark.parametrize("draft", [None, 40])
@pytest.mark.parametrize("loss", ["ce", "kl", "tv", "e2e_tv"])
@pytest.mark.integration
def test_losses_from_the_cache_equal_the_live_ones(cached, loss, draft):
    from mtp_train.config import HeadsConfig, LossConfig
    from mtp_train.heads.persist import build_heads
    from mtp_train.lit.data import MTPDataModule
    from mtp_train.lit.module import MTPHeadsModule

    cfg, backbone, path = cached
    draft_ids = None if draft is None else torch.arange(0, 4 * draft, 4)  # every 4th token id
    heads = build_heads(HeadsConfig(type="chained", k=2), backbone, draft_ids=draft_ids)
    module = MTPHeadsModule(backbone, heads, LossConfig(name=loss, adamtp=True, theta=0.05), cfg.train)
    out = {}
    for name, cache in (("live", None), ("cache", cache_mod.HiddenCache(path))):
        dm = MTPDataModule(data_dirs(cfg), backbone.tokenizer.pad_token_id, 4, 96, cache=cache)
        dm.setup()
        batch = next(iter(dm.val_dataloader()))
        assert ("hidden" in batch) == (cache is not None)
        with torch.no_grad():
            out[name] = module.model_step(batch, "val").item()
    assert out["cache"] == pytest.approx(out["live"], rel=1e-2, abs=1e-4)


@pytest.mark.integration
def test_cache_is_keyed_and_used_only_for_matching_inputs(cached, typed_cfg, caplog):
    from mtp_train.data.prepared import open_cache
    from tests.helpers import run_train

    cfg, backbone, path = cached
    assert open_cache(cfg, backbone) is not None
    other = typed_cfg(*FAST, "train.max_length=80")
    assert open_cache(other, backbone) is None  # another row length: another key
    assert open_cache(typed_cfg(*FAST, "train.use_cache=false"), backbone) is None
    # hostile round 4: a damaged manifest made training fall back to the live backbone without a word
    from mtp_train.errors import DataError

    manifest = path / "manifest.json"
    good = manifest.read_text()
    try:
        for damaged, why in (("{not json", "not a readable JSON object"), ("[]", "not a readable JSON object"),
                             (json.dumps({**json.loads(good), "config_hash": "x"}), "records key 'x'")):
            manifest.write_text(damaged)
            with pytest.raises(DataError, match=rf"manifest.json: {why}, not this cache's .*delete it and run"):
                open_cache(cfg, backbone)
    finally:
        manifest.write_text(good)
    import logging

    with caplog.at_level(logging.INFO):
        metrics = run_train(cfg)
    assert "training from the hidden-state cache" in caplog.text
    # the same run with the backbone live: the same training, up to the cache's rounding
    live = run_train(typed_cfg(*FAST, "train.use_cache=false", f"paths.output_dir={cfg.paths.output_dir}-live"))
    for key in ("val/loss", "val/alpha_d1", "val/alpha_d2"):
        assert metrics[key] == pytest.approx(live[key], rel=1e-2, abs=1e-4), key


@pytest.mark.integration
def test_a_killed_cache_build_resumes_from_its_shards(typed_cfg, monkeypatch):
    cfg = typed_cfg(*FAST)
    for stage in ("data", "distill"):
        run_prep(dataclasses.replace(cfg, stage=stage))
    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import load_splits

    backbone = load_backbone(cfg.backbone)
    key, path = cache_location(cfg, backbone)
    splits = load_splits(data_dirs(cfg))
    cache_mod.build_cache(splits, backbone, path, key, 96, shard_rows=8)
    reference = {s: [cache_mod.HiddenCache(path).row(s, i).copy() for i in range(len(splits[s]))]
                 for s in splits}
    (path / "manifest.json").unlink()
    (path / "train-00002.npy").unlink()  # as if killed while writing the third shard
    calls = []
    real = cache_mod._hidden_rows
    monkeypatch.setattr(cache_mod, "_hidden_rows", lambda *a: calls.append(1) or real(*a))
    cache_mod.build_cache(splits, backbone, path, key, 96, shard_rows=8, batch_tokens=8 * 96)
    assert len(calls) == 1  # only the missing shard was computed
    again = cache_mod.HiddenCache(path)
    for s in splits:
        for i, ref in enumerate(reference[s]):
            np.testing.assert_array_equal(again.row(s, i), ref)


def test_length_batches_group_similar_rows_within_the_token_budget():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 200, size=300)]
    batches = cache_mod.length_batches(lengths, 512)
    assert sorted(i for b in batches for i in b) == list(range(300))  # every row once
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) == 1 or len(b) * longest <= 512
    # longest first, so a batch's rows are never longer than the previous batch's shortest
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat, reverse=True)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded <= 1.1 * sum(lengths)  # far less padding than row-order batches of 8
    assert cache_mod.length_batches([600, 10], 512) == [[0], [1]]


@pytest.mark.integration
def test_distilled_states_are_reused_and_equal_a_fresh_forward(typed_cfg, tmp_path):
    """Distillation keeps the states generate computed; the cache copies them. Both must equal
    the cache's own forward over the same rows (computed here with `known=None`)."""
    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import cache_compute, load_splits

    cfg = typed_cfg(*FAST)
    for stage in ("data", "distill"):
        run_prep(dataclasses.replace(cfg, stage=stage))
    backbone = load_backbone(cfg.backbone)
    key, _ = cache_location(cfg, backbone)
    splits = load_splits(data_dirs(cfg))
    compute = cache_compute(cfg, backbone)
    known = cache_mod.reusable_states(data_dirs(cfg), backbone.identity, compute)
    assert known is not None
    m_reused = cache_mod.build_cache(splits, backbone, tmp_path / "reused", key, 96, known=known)
    m_fresh = cache_mod.build_cache(splits, backbone, tmp_path / "fresh", key, 96)
    assert m_reused["tokens_computed_this_run"] == 0 and m_reused["tokens_reused_this_run"] == m_fresh["tokens"]
    reused, fresh = cache_mod.HiddenCache(tmp_path / "reused"), cache_mod.HiddenCache(tmp_path / "fresh")
    for s in splits:
        for i in range(len(splits[s])):
            a, b = reused.states(s, i), fresh.states(s, i)
            np.testing.assert_allclose(a[0].astype(np.float32), b[0].astype(np.float32), rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(a[1], b[1], rtol=1e-4, atol=1e-4)  # lse, entropy
            assert (a[2] == b[2]).mean() > 0.99  # greedy tokens (a near-tie may flip)
    # with the original rows first (train.data_use=mix), only the distilled rows have states
    mix = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, data_use="mix"))
    known_mix = cache_mod.reusable_states(data_dirs(mix), backbone.identity, compute)
    n_labelled = len(load_splits(data_dirs(mix))["train"]) - len(splits["train"])
    assert n_labelled > 0 and known_mix("train", 0) is None and known_mix("train", n_labelled - 1) is None
    np.testing.assert_array_equal(known_mix("train", n_labelled + 3)[0], known("train", 3)[0])
    # states made in another dtype or by another backbone are not reused
    assert cache_mod.reusable_states(data_dirs(cfg), backbone.identity, "bfloat16") is None
    assert cache_mod.reusable_states(data_dirs(cfg), {"name": "other"}, compute) is None


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_killed_data_stage_publishes_nothing_and_the_rerun_gives_the_same_rows(typed_cfg, monkeypatch):
    """Killed between writing and publishing, the data stage leaves no dataset (only its temporary,
    which the next run removes once its process is gone) and the rerun builds the same rows."""
    import shutil

    from datasets import load_from_disk

    import data_prep.build as build_mod
    from mtp_train.layout import labelled_dir

    cfg = dataclasses.replace(typed_cfg(*FAST), stage="data")
    run_prep(cfg)
    out = labelled_dir(cfg)
    straight = load_from_disk(str(out))["train"]["input_ids"]
    shutil.rmtree(out)

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(build_mod, "publish_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        run_prep(cfg)
    monkeypatch.undo()
    assert not out.exists()
    (tmp,) = out.parent.glob(out.name + ".tmp-*")
    tmp.rename(out.parent / (out.name + ".tmp-999999999"))  # as left by a process that is gone
    run_prep(cfg)
    assert load_from_disk(str(out))["train"]["input_ids"] == straight
    assert not list(out.parent.glob(out.name + ".tmp-*"))


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_damaged_cache_is_refused_naming_the_file_and_a_leftover_temporary_is_not_counted(typed_cfg, tmp_path):
    """Every way a cache on disk gets damaged (ids out of the vocabulary, truncated or deleted files,
    edited offsets, another width, a missing shard, rows of other lengths) is refused when the cache
    is opened, in one line naming the file; a temporary file a killed build left is removed and never
    counted in the manifest."""
    import shutil

    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import load_splits
    from mtp_train.errors import DataError
    from mtp_train.lit.data import CachedRows

    cfg = typed_cfg(*FAST)
    for stage in ("data", "distill"):
        run_prep(dataclasses.replace(cfg, stage=stage))
    backbone = load_backbone(cfg.backbone)
    key, good = cache_location(cfg, backbone)
    splits = load_splits(data_dirs(cfg))
    manifest = cache_mod.build_cache(splits, backbone, good, key, 96, shard_rows=8)
    V = backbone.vocab_size

    def edit(name, fn):
        return lambda d: np.save(d / name, fn(np.load(d / name)))

    def cut(name):
        return lambda d: (d / name).write_bytes((d / name).read_bytes()[:200])

    def drop_shard(d):
        for f in d.glob("train-00001.*"):
            f.unlink()

    cases = [
        (edit("train-00000.top.npy", lambda a: np.where(np.arange(len(a)) == 3, 10**6, a).astype(a.dtype)),
         rf"train-00000\.top\.npy: greedy token id 1000000 outside the vocabulary \[0, {V}\)"),
        (edit("train-00000.top.npy", lambda a: (a - 10**6).astype(a.dtype)), r"train-00000\.top\.npy: greedy token id -"),
        (cut("train-00001.npy"), r"train-00001\.npy: not a readable \.npy array"),
        (lambda d: (d / "validation-00000.offsets.npy").unlink(), r"validation-00000\.offsets\.npy: missing"),
        (edit("train-00000.offsets.npy", lambda a: a[:-1]), r"train-00000\.offsets\.npy: offsets do not cut"),
        (edit("train-00000.npy", lambda a: a[:, :-1]), r"train-00000\.npy: hidden states float16 of shape \[\d+, 63\]"),
        (edit("train-00000.stats.npy", lambda a: a[:, :1]), r"train-00000\.stats\.npy: stats float32 of shape"),
        (edit("train-00000.top.npy", lambda a: a.astype(np.float32)), r"top\.npy: greedy tokens float32"),
        # hostile round 4: non-finite states trained to NaN losses without naming the cache
        (edit("train-00001.npy", lambda a: np.where(np.arange(len(a))[:, None] == 5, np.nan, a).astype(a.dtype)),
         r"train-00001\.npy: hidden states hold NaN or inf at token 5"),
        (edit("validation-00000.stats.npy", lambda a: np.where(np.arange(len(a))[:, None] == 2, np.inf, a).astype(a.dtype)),
         r"validation-00000\.stats\.npy: stats hold NaN or inf at token 2"),
        (drop_shard, r"train-00001\.npy: train has 8 rows in 1 shard\(s\) up to this missing one, the manifest says 24"),
        # same shape and dtype, other values: only the manifest's digests can tell
        (edit("train-00001.npy", np.zeros_like), r"train-00001\.npy: its contents changed after the cache was built"),
        (edit("validation-00000.stats.npy", lambda a: np.full_like(a, np.nan)),
         r"validation-00000\.stats\.npy: its contents changed"),
    ]
    for i, (damage, message) in enumerate(cases):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        damage(bad)
        if i < len(cases) - 2:  # the structural checks: as if the damage came with matching digests
            m = json.loads((bad / "manifest.json").read_text())
            m["digests"] = cache_mod.shard_digests(bad)
            (bad / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(DataError, match=message) as err:
            cache_mod.HiddenCache(bad, vocab_size=V)
        assert "delete it and run `mtp-prep stage=cache` again" in str(err.value)
    # rows whose states are shorter than the data's rows: the shard opens, the data refuses it
    bad = tmp_path / "bad"
    shutil.rmtree(bad)
    shutil.copytree(good, bad)
    edit("train-00000.offsets.npy", lambda a: np.where(np.arange(len(a)) == 1, a - 1, a))(bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["digests"] = cache_mod.shard_digests(bad)  # consistent digests: rows that came from other data
    (bad / "manifest.json").write_text(json.dumps(m))
    (bad / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k != "digests"}))
    with pytest.raises(DataError, match=r"manifest.json: the manifest records no digest of its shard files"):
        cache_mod.HiddenCache(bad, vocab_size=V)
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"train row 0 has states for \d+ tokens, the data's row has \d+ \(2 row"):
        CachedRows(splits["train"], cache_mod.HiddenCache(bad, vocab_size=V), "train")
    # a killed build's temporary file: removed by the next build, never counted
    (good / "manifest.json").unlink()
    stray = good / "train-00000.npy.tmp-99999999.npy"
    np.save(stray, np.zeros((1000, 64), np.float16))
    again = cache_mod.build_cache(splits, backbone, good, key, 96, shard_rows=8)
    assert not stray.exists()
    assert (again["tokens"], again["bytes"]) == (manifest["tokens"], manifest["bytes"])
