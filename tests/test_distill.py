"""Self-distillation on the tiny backbone: the rows are the backbone's own greedy text, and a killed
run resumes to exactly the rows of an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from data_prep import distill as distill_mod
from data_prep.build import prepare_dataset
from mtp_train.config import DataConfig, DistillConfig
from mtp_train.data.prepared import load_prepared
from mtp_train.data.template import IGNORE, render_prompt
from mtp_train.errors import DataError

pytestmark = pytest.mark.integration  # every test runs the data or distill stage

DCFG = DistillConfig(max_new_tokens=12, max_prompt_tokens=112, batch_size=4, shard_size=8,
                     max_train_prompts=20, max_val_prompts=6, autocast="float32")


@pytest.fixture
def labelled(tmp_path, tiny_tokenizer):
    cfg = DataConfig(name="tiny", source="tiny", tiny_rows=40, max_length=128, val_fraction=0.2,
                     output_dir=str(tmp_path / "labelled"))
    manifest = prepare_dataset(cfg, tiny_tokenizer)
    return cfg, manifest


def _rows(path):
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    return {s: ds[s].to_list() for s in ds}


def test_data_stage_manifest_and_skip(labelled, tiny_tokenizer, caplog):
    cfg, m = labelled
    assert m["counts"]["kept"] == 40 and m["splits"] == {"train": 32, "validation": 8}
    assert m["tokenizer"]["vocab_size"] == len(tiny_tokenizer) and m["max_length"] == 128
    again = prepare_dataset(cfg, tiny_tokenizer)
    assert again["config_hash"] == m["config_hash"]
    changed = prepare_dataset(dataclasses.replace(cfg, max_length=96), tiny_tokenizer)
    assert changed["config_hash"] != m["config_hash"] and changed["max_length"] == 96


def test_split_is_deterministic_by_seed(tmp_path, tiny_tokenizer):
    def ids(seed, name):
        cfg = DataConfig(name="t", source="tiny", tiny_rows=40, max_length=128, val_fraction=0.2,
                         seed=seed, output_dir=str(tmp_path / name))
        prepare_dataset(cfg, tiny_tokenizer)
        return [r["id"] for r in _rows(tmp_path / name)["validation"]]

    assert ids(0, "a") == ids(0, "b")
    assert ids(0, "a") != ids(1, "c")


def test_distilled_rows_are_the_backbones_greedy_answers(tmp_path, labelled, tiny_backbone):
    cfg, _ = labelled
    m = distill_mod.distill(tmp_path / "labelled", tmp_path / "out", tiny_backbone, DCFG, 128)
    assert m["splits"] == {"train": 20, "validation": 6}
    rows = _rows(tmp_path / "out")
    tok, model = tiny_backbone.tokenizer, tiny_backbone.model
    for r in rows["train"][:8]:
        prompt = render_prompt(tok, r["messages"][:-1])
        n = len(prompt)
        assert r["input_ids"][:n] == prompt
        assert r["labels"][:n] == [IGNORE] * n and r["labels"][n:] == r["input_ids"][n:]
        assert 0 < r["num_assistant_tokens"] <= DCFG.max_new_tokens
        # every answer token is the argmax of the backbone given what precedes it (greedy)
        with torch.no_grad():
            logits = model(torch.tensor([r["input_ids"]])).logits[0]
        for t in range(n, len(r["input_ids"])):
            top2 = logits[t - 1].topk(2)
            if top2.values[0] - top2.values[1] > 1e-4:  # ignore float near-ties from batching
                assert r["input_ids"][t] == top2.indices[0].item(), (r["id"], t)
    assert rows["train"][0]["messages"][-1]["role"] == "assistant"


@pytest.mark.parametrize("do_sample", [False, True])
def test_kill_and_resume_gives_exactly_the_uninterrupted_rows(tmp_path, labelled, tiny_backbone,
                                                              monkeypatch, do_sample):
    dcfg = dataclasses.replace(DCFG, do_sample=do_sample, temperature=1.0)
    src = tmp_path / "labelled"
    distill_mod.distill(src, tmp_path / "straight", tiny_backbone, dcfg, 128)

    real_save, real_gen = distill_mod._save_shard, distill_mod._generate_shard
    saved, generated = [], []

    def dying_save(*args, **kw):
        if len(saved) == 2:
            raise KeyboardInterrupt("killed")  # dies after two finished shards
        saved.append(args[1])
        return real_save(*args, **kw)

    monkeypatch.setattr(distill_mod, "_save_shard", dying_save)
    with pytest.raises(KeyboardInterrupt):
        distill_mod.distill(src, tmp_path / "resumed", tiny_backbone, dcfg, 128)
    shards = tmp_path / "resumed.shards"
    assert sorted(p.name for p in shards.iterdir() if p.is_dir()) == ["train-00000", "validation-00000"]
    assert not (tmp_path / "resumed").exists()

    def counting_gen(*args, **kw):
        generated.append(kw["seed"])
        return real_gen(*args, **kw)

    monkeypatch.setattr(distill_mod, "_save_shard", real_save)
    monkeypatch.setattr(distill_mod, "_generate_shard", counting_gen)
    distill_mod.distill(src, tmp_path / "resumed", tiny_backbone, dcfg, 128)
    assert len(generated) == 2  # of 4 shards (1 validation, then 3 train), the last two
    assert _rows(tmp_path / "resumed") == _rows(tmp_path / "straight")
    assert not shards.exists()


def _states(out):
    """{file name: array} of a distilled directory's kept states."""
    import numpy as np

    return {f.name: np.load(f) for f in sorted((out / "states").glob("*.npy"))}


def test_a_deadline_stops_the_train_shards_and_a_run_without_one_finishes_them(tmp_path, labelled, tiny_backbone,
                                                                               monkeypatch):
    import time

    import numpy as np

    src = tmp_path / "labelled"
    distill_mod.distill(src, tmp_path / "straight", tiny_backbone, DCFG, 128)
    straight = _rows(tmp_path / "straight")
    dcfg = dataclasses.replace(DCFG, min_train_prompts=5)
    # a stop already passed: the validation shard, then train shards up to the floor (one shard of 8)
    m = distill_mod.distill(src, tmp_path / "cut", tiny_backbone, dcfg, 128, stop_at=time.time() - 1)
    assert m["stopped_at_budget"] == {"train_prompts": 8, "planned": 20}
    assert m["splits"] == {"train": 8, "validation": 6}
    straight_hash = json.loads((tmp_path / "straight" / "manifest.json").read_text())["config_hash"]
    assert m["config_hash"] != straight_hash and m["plan_hash"] == straight_hash  # the cache key sees fewer rows
    cut = _rows(tmp_path / "cut")
    assert cut["validation"] == straight["validation"] and cut["train"] == straight["train"][:8]
    states = json.loads((tmp_path / "cut" / "states" / "manifest.json").read_text())
    assert states["rows"] == {"train": 8, "validation": 6}
    assert (tmp_path / "cut.shards").is_dir()  # kept for a run that finishes it
    # what training and the cache read: the original answers of the conversations distillation reached only
    from mtp_train.data.prepared import load_splits

    read = load_splits([src, tmp_path / "cut"])
    originals = _rows(src)["train"]
    assert len(read["train"]) == 8 + 8 and read["train"]["input_ids"][:8] == [r["input_ids"] for r in originals[:8]]
    assert len(read["validation"]) == 8 + 6
    assert len(load_splits([src, tmp_path / "straight"])["train"]) == 32 + 20
    # and the cache finds the kept states at the rows' places in that reading
    from data_prep.cache import reusable_states
    from mtp_train.data.cache import HiddenCache

    known = reusable_states([src, tmp_path / "cut"], tiny_backbone.identity, "float32")
    assert known("train", 7) is None  # an original answer: no states kept
    np.testing.assert_array_equal(known("train", 8 + 3)[0], HiddenCache(tmp_path / "cut" / "states").states("train", 3)[0])
    # mtp-clp's labels index the distilled rows after the originals read: 8 of them, not the 32 prepared
    import mtp_train.data.prepared as prepared_mod
    import mtp_train.layout as layout_mod
    from mtp_train.pipeline.clp_run import distilled_cache

    monkeypatch.setattr(layout_mod, "data_dirs", lambda cfg: [src, tmp_path / "cut"])
    monkeypatch.setattr(layout_mod, "distilled_dir", lambda cfg: tmp_path / "cut")
    monkeypatch.setattr(prepared_mod, "open_cache", lambda *a, **k: "a cache")
    rows, _, first = distilled_cache(None, None, "train")
    assert first == 8 and rows[first]["input_ids"] == cut["train"][0]["input_ids"]
    monkeypatch.undo()
    # the stop's time is honoured, not just the floor: a stop an hour away distils every prompt
    far = distill_mod.distill(src, tmp_path / "far", tiny_backbone, dcfg, 128, stop_at=time.time() + 3600)
    assert "stopped_at_budget" not in far and far["splits"] == {"train": 20, "validation": 6}

    def boom(*a, **k):
        raise AssertionError("should not generate again")

    monkeypatch.setattr(distill_mod, "_generate_shard", boom)  # another deadline: the rows are reused
    again = distill_mod.distill(src, tmp_path / "cut", tiny_backbone, dcfg, 128, stop_at=time.time() - 1)
    assert again["stopped_at_budget"] == m["stopped_at_budget"] and again["config_hash"] == m["config_hash"]
    monkeypatch.undo()
    # a higher floor is not met by the rows held: distilled on to it, and stopped again there
    higher = distill_mod.distill(src, tmp_path / "cut", tiny_backbone, dataclasses.replace(dcfg, min_train_prompts=12), 128,
                                 stop_at=time.time() - 1)
    assert higher["stopped_at_budget"] == {"train_prompts": 16, "planned": 20}
    assert _rows(tmp_path / "cut")["train"] == straight["train"][:16]
    # no deadline: the rest is distilled, to exactly the uninterrupted run's rows and states
    full = distill_mod.distill(src, tmp_path / "cut", tiny_backbone, dcfg, 128)
    assert "stopped_at_budget" not in full and full["splits"] == {"train": 20, "validation": 6}
    assert full["config_hash"] == straight_hash
    assert _rows(tmp_path / "cut") == straight
    assert len(load_splits([src, tmp_path / "cut"])["train"]) == 32 + 20  # every original again
    a, b = _states(tmp_path / "cut"), _states(tmp_path / "straight")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "cut.shards").exists()


def test_changed_settings_discard_old_shards(tmp_path, labelled, tiny_backbone, monkeypatch):
    src = tmp_path / "labelled"
    calls = []
    real_save = distill_mod._save_shard

    def dying_save(*args, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real_save(*args, **kw)

    monkeypatch.setattr(distill_mod, "_save_shard", dying_save)
    with pytest.raises(KeyboardInterrupt):
        distill_mod.distill(src, tmp_path / "out", tiny_backbone, DCFG, 128)
    monkeypatch.setattr(distill_mod, "_save_shard", real_save)
    other = dataclasses.replace(DCFG, max_new_tokens=5)
    m = distill_mod.distill(src, tmp_path / "out", tiny_backbone, other, 128)
    assert m["generation"]["max_new_tokens"] == 5
    assert max(r["num_assistant_tokens"] for r in _rows(tmp_path / "out")["train"]) <= 5


def test_up_to_date_distillation_is_skipped(tmp_path, labelled, tiny_backbone, monkeypatch):
    src = tmp_path / "labelled"
    first = distill_mod.distill(src, tmp_path / "out", tiny_backbone, DCFG, 128)

    def boom(*a, **k):
        raise AssertionError("should not generate again")

    monkeypatch.setattr(distill_mod, "_generate_shard", boom)
    again = distill_mod.distill(src, tmp_path / "out", tiny_backbone, DCFG, 128)
    assert again["config_hash"] == first["config_hash"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source_hash"] and manifest["backbone"] == "tiny-llama"
    monkeypatch.undo()
    (arrow,) = (tmp_path / "out" / "train").glob("*.arrow")  # up to date by its manifest, but damaged
    arrow.write_bytes(arrow.read_bytes()[:3000])
    redone = distill_mod.distill(src, tmp_path / "out", tiny_backbone, DCFG, 128)
    assert redone["splits"] == first["splits"] and len(load_prepared(tmp_path / "out")["train"]) == first["splits"]["train"]


def test_long_prompts_are_skipped_and_counted(tmp_path, labelled, tiny_backbone):
    dcfg = dataclasses.replace(DCFG, max_prompt_tokens=60)  # every tiny prompt is longer (20 + 6)
    with pytest.raises(DataError, match=r"no train prompt .*'prompt longer than data.distill"
                                        r".max_prompt_tokens': 26"):
        distill_mod.distill(tmp_path / "labelled", tmp_path / "out", tiny_backbone, dcfg, 128)


@pytest.mark.bad_input
def test_an_empty_validation_split_is_an_error_not_a_broken_dataset(tmp_path, labelled, tiny_backbone):
    dcfg = dataclasses.replace(DCFG, max_val_prompts=0)
    with pytest.raises(DataError, match="no validation prompt"):
        distill_mod.distill(tmp_path / "labelled", tmp_path / "out", tiny_backbone, dcfg, 128)


def test_distillation_is_redone_for_another_backbone(tmp_path, labelled, tiny_backbone, monkeypatch):
    import copy

    first = distill_mod.distill(tmp_path / "labelled", tmp_path / "out", tiny_backbone, DCFG, 128)
    other = copy.copy(tiny_backbone)
    other.identity = {**tiny_backbone.identity, "dtype": "bfloat16"}
    calls = []
    real = distill_mod._generate_shard
    monkeypatch.setattr(distill_mod, "_generate_shard", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = distill_mod.distill(tmp_path / "labelled", tmp_path / "out", other, DCFG, 128)
    assert calls and again["config_hash"] != first["config_hash"]


@pytest.mark.bad_input
def test_the_engine_distils_greedily_only_and_hf_rows_keep_their_hash():
    """data.distill.engine=vllm with do_sample is refused naming the key; choosing hf (the default)
    leaves the plan's hash what it was before the engine existed, so no finished rows are redone."""
    from data_prep.distill import distill_plan
    from mtp_train.backbone import build_tiny_tokenizer
    from mtp_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data.distill.engine: vllm distils greedily only"):
        DistillConfig(engine="vllm", do_sample=True)
    with pytest.raises(ConfigError, match=r"^data.distill.engine: unknown value 'sglang'"):
        DistillConfig(engine="sglang")
    tok, cpu = build_tiny_tokenizer(), torch.device("cpu")
    hf = distill_plan({"config_hash": "x"}, "b", tok, DistillConfig(), 64, cpu)
    assert "engine" not in hf["generation"]
    assert distill_plan({"config_hash": "x"}, "b", tok, DistillConfig(engine="vllm"), 64, cpu)["generation"]["engine"] == "vllm"
