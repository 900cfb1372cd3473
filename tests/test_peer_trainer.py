"""The peer's trainer side by side with ours: our cache written as speculators' training data
(mtp_train/data/speculators_format.py), and EAGLE-3 drafters saved by speculators read back as a
run's heads (`heads.from_speculators`), so both are scored by the same validation and decoder."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from data_prep.stages import run_prep
from mtp_train.depth_targets import IGNORE
from mtp_train.errors import ConfigError, MtpError
from tests.helpers import run_train
from tests.test_cache import FAST

EAGLE = ["heads=eagle3", "heads.k=2", "heads.draft_vocab=64", "backbone.tiny.num_layers=4"]


def _trained(typed_cfg, tmp_path, *overrides):
    run = tmp_path / "run"
    cfg = typed_cfg(*FAST, *EAGLE, *overrides, f"hydra.run.dir={run}", f"paths.output_dir={run}")
    for stage in ("data", "distill", "cache"):  # trained from the cache, as the peer is
        run_prep(dataclasses.replace(cfg, stage=stage))
    metrics = run_train(cfg)
    return cfg, run, metrics


def test_the_loss_mask_marks_the_positions_whose_next_token_is_an_answer_token():
    labels = np.array([IGNORE, IGNORE, 5, 6, IGNORE, 7])
    assert loss_mask(labels).tolist() == [0, 1, 1, 0, 1, 0]


def loss_mask(labels):
    from mtp_train.data.speculators_format import loss_mask_from_labels

    return loss_mask_from_labels(labels)


@pytest.mark.integration
def test_our_cache_in_speculators_format_holds_the_same_rows_states_and_teacher(typed_cfg, tmp_path):
    from datasets import load_from_disk

    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import load_splits, open_cache
    from mtp_train.data.speculators_format import final_norm_weight, write_speculators_data
    from mtp_train.heads.persist import load_heads
    from mtp_train.layout import data_dirs

    cfg, run, _ = _trained(typed_cfg, tmp_path)
    backbone = load_backbone(cfg.backbone)
    heads, _ = load_heads(run, backbone)
    cache = open_cache(cfg, backbone)
    splits = load_splits(data_dirs(cfg))
    out = tmp_path / "peer_data"
    summary = write_speculators_data(cache, splits, final_norm_weight(backbone), out, heads.draft_ids,
                                     backbone.vocab_size)
    n_train, n_val = len(splits["train"]), len(splits["validation"])
    assert summary["rows"] == n_train + n_val and int(summary["rows"] * summary["train_data_ratio"]) == n_train
    ds = load_from_disk(str(out)).with_format("numpy")
    assert len(ds) == n_train + n_val
    norm = backbone.model.get_decoder().norm
    for row, (split, i) in [(0, ("train", 0)), (n_train - 1, ("train", n_train - 1)), (n_train, ("validation", 0))]:
        f = load_file(str(out / "hidden_states" / f"hs_{row}.safetensors"))
        src = splits[split][i]
        T = cache.lengths(split)[i]
        assert f["hidden_states"].shape == (T, len(cache.aux_layers) + 1, backbone.hidden_size)
        assert f["token_ids"].tolist() == src["input_ids"][:T] == ds[row]["input_ids"].tolist()
        assert ds[row]["loss_mask"].tolist() == loss_mask(np.array(src["labels"][:T])).tolist()
        np.testing.assert_allclose(f["hidden_states"][:, :-1].flatten(1).float().numpy(),
                                   cache.aux(split, i).astype(np.float32), rtol=1e-3, atol=1e-3)
        # the verifier's own norm on the last slot gives back the cached state, so its teacher is ours
        cached = torch.from_numpy(np.asarray(cache.row(split, i), np.float32))
        with torch.no_grad():
            again = norm(f["hidden_states"][:, -1].float())
            torch.testing.assert_close(again, cached, rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(backbone.lm_head(again).log_softmax(-1),
                                       backbone.lm_head(cached).log_softmax(-1), rtol=1e-2, atol=1e-2)
    d2t, t2d = np.load(out / "d2t-64.npy"), np.load(out / "t2d-64.npy")
    assert (d2t + np.arange(64)).tolist() == heads.draft_ids.tolist()
    assert t2d.dtype == bool and t2d.sum() == 64 and t2d[heads.draft_ids.numpy()].all()


@pytest.mark.integration
def test_a_speculators_drafter_is_read_back_as_a_runs_heads_and_scores_the_same(typed_cfg, tmp_path):
    from mtp_train.pipeline.serving import export_for_engine

    cfg, run, metrics = _trained(typed_cfg, tmp_path)
    served = export_for_engine(run, "eagle3", tmp_path / "served")
    back = tmp_path / "imported"
    cfg2 = typed_cfg(*FAST, *EAGLE, f"heads.from_speculators={served}", "trainer.max_steps=0",
                     f"hydra.run.dir={back}", f"paths.output_dir={back}")
    metrics2 = run_train(cfg2)
    a, b = load_file(str(run / "heads.safetensors")), load_file(str(back / "heads.safetensors"))
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name].to(b[name].dtype), rtol=0, atol=0, msg=name)
    # the same heads on the same validation rows: the same figures
    for key in ("val/sim_tau", "val/agree_d1", "val/agree_d2"):
        assert metrics2[key] == pytest.approx(metrics[key], abs=2e-3), key
    meta = json.loads((back / "heads.json").read_text())
    assert meta["recipe"]["steps"] == 0 and meta["recipe"]["from_speculators"]["dir"] == str(served.resolve())
    assert (back / "tree_stats.json").is_file()
    # trained by the peer, not here (0 steps): it is still exported for the engines, as the same weights
    again = export_for_engine(back, "eagle3", tmp_path / "served_again")
    w0, w1 = load_file(str(served / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert set(w0) == set(w1) and all(torch.equal(w0[n], w1[n]) for n in w0)
    # a rerun is the finished run; other weights in the same folder make it another recipe
    assert run_train(cfg2) == metrics2
    w = load_file(str(served / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"] * 0.5
    save_file(w, str(served / "model.safetensors"))
    run_train(cfg2)
    assert not torch.equal(load_file(str(back / "heads.safetensors"))["fc.weight"], b["fc.weight"])


@pytest.mark.integration
def test_a_speculators_drafter_our_heads_cannot_express_is_refused_naming_the_key(typed_cfg, tmp_path):
    from mtp_train.pipeline.serving import export_for_engine

    _, run, _ = _trained(typed_cfg, tmp_path)
    served = export_for_engine(run, "eagle3", tmp_path / "served")
    config = json.loads((served / "config.json").read_text())

    def imported(*overrides, edit=None):
        d = tmp_path / f"variant{len(list(tmp_path.glob('variant*')))}"
        d.mkdir()
        (d / "model.safetensors").write_bytes((served / "model.safetensors").read_bytes())
        (d / "config.json").write_text(json.dumps({**config, **(edit or {})}))
        out = tmp_path / f"out-{d.name}"
        run_train(typed_cfg(*FAST, *EAGLE, f"heads.from_speculators={d}", "trainer.max_steps=0", *overrides,
                            f"hydra.run.dir={out}", f"paths.output_dir={out}"))

    with pytest.raises(MtpError, match="norm_output is true"):
        imported(edit={"norm_output": True})
    with pytest.raises(MtpError, match="speculators_model_type is 'mtp'"):
        imported(edit={"speculators_model_type": "mtp"})
    with pytest.raises(ConfigError, match=r"heads.aux_layers: .* fuses layers \[1, 2, 3\]"):
        imported("heads.aux_layers=[1,2]")
    with pytest.raises(ConfigError, match="heads.norm_before_residual: .* set heads.norm_before_residual=true"):
        imported(edit={"norm_before_residual": True})
    with pytest.raises(ConfigError, match="heads.draft_vocab: .* scores 64 tokens; set heads.draft_vocab=64"):
        imported("heads.draft_vocab=32")
    w = load_file(str(served / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] + 0.1
    (tmp_path / "own_head").mkdir()
    save_file(w, str(tmp_path / "own_head" / "model.safetensors"))
    (tmp_path / "own_head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="heads.lm_head: .* has an LM head of its own"):
        run_train(typed_cfg(*FAST, *EAGLE, f"heads.from_speculators={tmp_path / 'own_head'}", "trainer.max_steps=0",
                            f"paths.output_dir={tmp_path}/own"))
    run_train(typed_cfg(*FAST, *EAGLE, f"heads.from_speculators={tmp_path / 'own_head'}", "trainer.max_steps=0",
                        "heads.lm_head=copy", f"paths.output_dir={tmp_path}/own_copy"))
    got = load_file(str(tmp_path / "own_copy" / "heads.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(got, w["lm_head.weight"].to(got.dtype))
    with pytest.raises(ConfigError, match="heads.from_speculators: reads EAGLE-3 drafters"):
        typed_cfg(*FAST, "heads=chained", f"heads.from_speculators={served}")
    with pytest.raises(ConfigError, match="trainer.max_steps: 0 trains nothing"):
        run_train(typed_cfg(*FAST, *EAGLE, "trainer.max_steps=0", f"paths.output_dir={tmp_path}/zero"))


@pytest.mark.reference
@pytest.mark.integration
def test_speculators_own_trainer_learns_from_our_cache_and_its_drafter_reads_back(typed_cfg, tmp_path):
    """The peer's trainer (speculators 0.9.0, its own environment, on the CPU through
    bench/peer_speculators_cpu.py) trains two steps on our tiny cache in its format; the checkpoint
    it saves is read back as heads and validated by ours."""
    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import load_splits, open_cache
    from mtp_train.data.speculators_format import final_norm_weight, write_speculators_data
    from mtp_train.heads.persist import load_heads
    from mtp_train.layout import data_dirs
    from mtp_train.pipeline.serving import SERVING_FILE, export_for_engine
    from tests.reference import env

    cfg, run, _ = _trained(typed_cfg, tmp_path)
    backbone = load_backbone(cfg.backbone)
    heads, _ = load_heads(run, backbone)
    served = export_for_engine(run, "eagle3", tmp_path / "served")  # a code-built backbone: saved beside
    verifier = json.loads((served / SERVING_FILE).read_text())["backbone"]
    data = tmp_path / "peer_data"
    s = write_speculators_data(open_cache(cfg, backbone), load_splits(data_dirs(cfg)), final_norm_weight(backbone),
                               data, heads.draft_ids, backbone.vocab_size)
    save = tmp_path / "peer"
    cmd = [str(env.python()), str(env.REPO / "bench" / "peer_speculators_cpu.py"), "--speculator-type", "eagle3",
           "--verifier-name-or-path", str(verifier), "--data-path", str(data),
           "--target-layer-ids", *map(str, s["aux_layers"]), "--draft-vocab-size", "64",
           "--d2t-path", str(data / "d2t-64.npy"), "--t2d-path", str(data / "t2d-64.npy"),
           "--mask-token-id", "0", "--total-seq-len", "256", "--num-workers", "0", "--draft-attn-impl", "sdpa",
           "--loss-implementation", "eager", "--on-missing", "raise", "--optimizer", "adamw", "--lr", "1e-3",
           "--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual",
           "--hidden-states-dtype", "float32", "--train-data-ratio", str(s["train_data_ratio"]),
           "--ttt-steps", "2", "--epochs", "1", "--max-steps", "2", "--no-resume-from-checkpoint",
           "--save-path", str(save)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    ckpt = next(p.parent for p in sorted(save.glob("*/model.safetensors")))
    back = tmp_path / "imported"
    metrics = run_train(typed_cfg(*FAST, *EAGLE, f"heads.from_speculators={ckpt}", "trainer.max_steps=0",
                                  f"hydra.run.dir={back}", f"paths.output_dir={back}"))
    assert np.isfinite(metrics["val/sim_tau"]) and metrics["val/sim_tau"] >= 1.0
    theirs = load_file(str(back / "heads.safetensors"))
    assert torch.equal(theirs["draft_ids"], heads.draft_ids)
    ours = load_file(str(run / "heads.safetensors"))
    assert not torch.equal(theirs["fc.weight"], ours["fc.weight"])  # trained by the peer, not ours copied
