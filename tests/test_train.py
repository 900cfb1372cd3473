"""mtp-train on the tiny backbone: every heads x loss x adamtp combination runs; only heads train."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from mtp_train.errors import MtpError
from tests.helpers import prep_cli, run_train, train_killed_at, wandb_offline_runs

FAST = ["debug=smoke"]  # conf/debug/smoke.yaml: the tiny backbone, four steps, no logger


@pytest.mark.parametrize("adamtp", [False, True])
@pytest.mark.parametrize("loss", ["ce", "kl", "tv", "e2e_tv"])
@pytest.mark.parametrize("heads", ["medusa", "chained"])
@pytest.mark.integration
def test_fast_dev_run_every_combination(typed_cfg, heads, loss, adamtp):
    cfg = typed_cfg(*FAST, f"heads={heads}", "heads.k=2", f"loss={loss}", f"loss.adamtp={adamtp}",
                    "trainer.fast_dev_run=true")
    metrics = run_train(cfg)
    assert {"val/sim_tau", "val/agree_d1", "val/agree_d2"} <= set(metrics)  # one step: finite, not learnt
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


# CE on the labelled rows: the patterned Q&A of the tiny source, which heads can learn in a few steps
LEARN = ["heads.k=2", "loss=ce", "train.data_use=labelled"]


@pytest.mark.parametrize("heads", ["medusa", "chained", "eagle3"])
@pytest.mark.integration
def test_heads_of_every_family_beat_untrained_heads_on_the_patterned_data(typed_cfg, tmp_path, heads):
    """After 16 steps the heads' validation loss is lower and their mean accuracy per depth higher
    than those of the untrained heads, measured by the same validation: a run whose learning rate
    is too small to move them (train.lr must be > 0). The random backbone's next-token distribution
    is nearly flat, so agreement with its own tokens (val/sim_tau) says little here."""

    def validation(name, lr, steps):
        m = run_train(typed_cfg(*FAST, f"heads={heads}", *LEARN, f"train.lr={lr}", f"trainer.max_steps={steps}",
                                f"trainer.val_check_interval={steps}", f"paths.output_dir={tmp_path}/{name}"))
        return m["val/loss"], (m["val/acc_d1"] + m["val/acc_d2"]) / 2

    untrained, trained = validation("untrained", 1e-12, 1), validation("trained", 3e-2, 16)
    assert trained[0] < 0.98 * untrained[0], (untrained, trained)
    assert trained[1] > untrained[1], (untrained, trained)


@pytest.mark.integration
def test_training_changes_only_the_heads_and_saves_only_them(typed_cfg, tmp_path, monkeypatch):
    import mtp_train.backbone as backbone_mod

    used = []
    real_load = backbone_mod.load_backbone

    def spying_load(bcfg):  # snapshot every backbone loaded (distillation's, then training's)
        bb = real_load(bcfg)
        used.append((bb, {n: p.clone() for n, p in bb.model.named_parameters()}))
        return bb

    monkeypatch.setattr(backbone_mod, "load_backbone", spying_load)
    cfg = typed_cfg(*FAST, "heads=medusa", "heads.k=2", "loss=ce", "train.lr=1e-2",
                    "train.sampled_tau_temperatures=[0.7,1.0]")
    metrics = run_train(cfg)
    run = tmp_path / "out"
    saved = load_file(str(run / "heads.safetensors"))
    meta = json.loads((run / "heads.json").read_text())
    assert meta["head_type"] == "medusa" and meta["k"] == 2
    assert meta["backbone"]["hidden_size"] == 64 and meta["metrics"]["val/sim_tau"] == metrics["val/sim_tau"]
    for t in ("0.7", "1.0"):  # speculative sampling's predicted tau, beside greedy's
        assert 1.0 <= meta["metrics"][f"val/sim_tau_t{t}"] <= 3.0
    assert meta["metrics"]["val/sim_tau_t0.7"] != meta["metrics"]["val/sim_tau_t1.0"]
    assert saved and all(k.startswith("blocks.") for k in saved)
    assert any(t.abs().sum() > 0 for k, t in saved.items() if k.endswith("linear.weight"))  # trained
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert set(ckpt["state_dict"]) == {f"heads.{k}" for k in saved}  # no backbone tensor
    bb, before = used[-1]  # the one training used
    after = dict(bb.model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(p, before[n]) for n, p in after.items())  # bit-identical after training


@pytest.mark.bad_input
@pytest.mark.integration
def test_non_finite_loss_names_the_step_and_stops(typed_cfg, monkeypatch):
    from mtp_train.heads.medusa import MedusaHeads

    real = MedusaHeads.forward
    monkeypatch.setattr(MedusaHeads, "forward", lambda self, *a, **k: real(self, *a, **k) * float("nan"))
    cfg = typed_cfg(*FAST, "heads=medusa", "heads.k=2", "loss=kl")
    with pytest.raises(MtpError, match=r"non-finite kl loss at step 0 \(train\)"):
        run_train(cfg)


@pytest.mark.integration
def test_local_sweep_writes_one_run_per_point(tmp_path):
    prep_cli(*FAST, cwd=tmp_path)
    r = subprocess.run([sys.executable, "-m", "mtp_train.cli.train", "-m", "loss=ce,e2e_tv", "heads.k=1,2",
                        *FAST, f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.parent.name for p in (tmp_path / "sweep").glob("*/heads.safetensors"))
    assert len(runs) == 4, runs


@pytest.mark.integration
def test_wandb_runs_offline_without_a_key_and_records_the_metrics(typed_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = typed_cfg(*FAST, "logger=wandb", "heads.k=2")
    run_train(cfg)
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    keys = (b"val/sim_tau", b"val/agree_d2", b"train/loss_step", b"val/acceptance_per_depth", b"data_use")
    import time

    for _ in range(40):  # W&B's writer is its own process: once in a full suite it flushed after finish()
        blob = b"".join(f.read_bytes() for f in runs[0].rglob("*.wandb"))
        if all(key in blob for key in keys):
            break
        time.sleep(0.5)
    for key in keys:
        assert key in blob, key
    # a single run keeps the experiment's name and joins no sweep group
    (record,) = wandb_offline_runs(tmp_path / "out")
    assert (record["name"], record["group"], record["tags"], record["job_type"]) == \
        (cfg.experiment_name, "", [], "train")


@pytest.mark.bad_input
@pytest.mark.integration
def test_resume_after_a_kill_gives_the_uninterrupted_step_and_weights(typed_cfg, tmp_path, monkeypatch):
    import lightning as L


    # 40 rows in batches of 8: 5 steps an epoch, so the step-6 checkpoint is mid-epoch
    common = [*FAST, "heads=chained", "heads.k=2", "loss=e2e_tv", "trainer.max_steps=8",
              "train.batch_size=8", "train.warmup_steps=2", "data.distill.max_train_prompts=40"]
    run_train(typed_cfg(*common, f"paths.output_dir={tmp_path}/straight"))
    straight = load_file(str(tmp_path / "straight" / "heads.safetensors"))

    # dies at step 7 (after the step-6 checkpoint)
    train_killed_at(typed_cfg(*common, f"paths.output_dir={tmp_path}/resumed"), 7, monkeypatch)
    steps = []
    monkeypatch.setattr(L.Trainer, "fit", lambda self, *a, _f=L.Trainer.fit, **k: (
        _f(self, *a, **k), steps.append(self.global_step))[0])
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_train(typed_cfg(*common, f"paths.output_dir={tmp_path}/resumed"))
    assert steps == [8]
    # Lightning's "dataloader is not resumable" warning is wrong for our sampler: not shown
    assert not [w for w in seen if "not resumable" in str(w.message)]
    resumed = load_file(str(tmp_path / "resumed" / "heads.safetensors"))
    assert resumed.keys() == straight.keys()
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("change,key", [("heads.k=3", "k"), ("heads=medusa", "head_type"),
                                        ("backbone.tiny.hidden_size=32", "hidden_size")])
@pytest.mark.bad_input
@pytest.mark.integration
def test_resuming_a_run_dir_without_a_recipe_with_other_heads_or_backbone_is_refused(typed_cfg, tmp_path,
                                                                                      change, key):
    from mtp_train.errors import ConfigError
    from mtp_train.layout import RUN_META

    run_train(typed_cfg(*FAST, "heads=chained", "heads.k=2"))
    meta = json.loads((tmp_path / "out" / RUN_META).read_text())
    del meta["recipe"]  # as a run directory from before recipes were recorded
    (tmp_path / "out" / RUN_META).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=f"was made with another {key}"):
        run_train(typed_cfg(*FAST, "heads=chained", "heads.k=2", change))


def _count_fits(monkeypatch) -> list:
    import lightning as L

    steps = []  # (global step at the start, at the end) of every Trainer.fit

    def counting_fit(self, *a, _f=L.Trainer.fit, **k):
        ckpt = k.get("ckpt_path")
        start = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] if ckpt else 0
        _f(self, *a, **k)
        steps.append((start, self.global_step))

    monkeypatch.setattr(L.Trainer, "fit", counting_fit)
    return steps


@pytest.mark.integration
def test_a_finished_run_is_skipped_a_longer_one_resumes_and_force_retrains(typed_cfg, tmp_path, monkeypatch):
    from mtp_train.layout import SUPERSEDED

    fits = _count_fits(monkeypatch)
    base = [*FAST, "heads=chained", "heads.k=2", "loss=kl"]
    first = run_train(typed_cfg(*base))
    weights = load_file(str(tmp_path / "out" / "heads.safetensors"))
    assert run_train(typed_cfg(*base)) == first  # same recipe and length: nothing trains
    assert fits == [(0, 4)]
    assert torch.equal(load_file(str(tmp_path / "out" / "heads.safetensors"))["proj.0.weight"],
                       weights["proj.0.weight"])
    run_train(typed_cfg(*base, "trainer.max_steps=6"))  # only longer: resumes at step 4
    assert fits == [(0, 4), (4, 6)]
    run_train(typed_cfg(*base, "trainer.max_steps=6", "force=true"))
    assert fits[-1] == (0, 6)
    assert list((tmp_path / "out" / SUPERSEDED).glob("*/heads.safetensors"))
    run_train(typed_cfg(*base, "force=true"))  # the same recipe superseded again: nothing is deleted
    kept = sorted((tmp_path / "out" / SUPERSEDED).glob("*/heads.json"))
    assert [json.loads(f.read_text())["recipe"]["steps"] for f in kept] == [6, 6]  # both 6-step runs
    assert kept[1].parent.name == kept[0].parent.name + "-2"


@pytest.mark.integration
def test_a_changed_recipe_trains_afresh_and_keeps_the_old_run(typed_cfg, tmp_path, monkeypatch):
    from mtp_train.layout import SUPERSEDED

    fits = _count_fits(monkeypatch)
    run_train(typed_cfg(*FAST, "heads=chained", "heads.k=2", "loss=kl"))
    old_meta = json.loads((tmp_path / "out" / "heads.json").read_text())
    run_train(typed_cfg(*FAST, "heads=chained", "heads.k=2", "loss=ce"))  # same shapes, other loss
    assert fits == [(0, 4), (0, 4)]
    assert json.loads((tmp_path / "out" / "heads.json").read_text())["loss"]["name"] == "ce"
    kept = tmp_path / "out" / SUPERSEDED / old_meta["recipe"]["recipe"]
    assert json.loads((kept / "heads.json").read_text())["loss"]["name"] == "kl"
    assert (kept / "checkpoints" / "last.ckpt").is_file() and (kept / "heads.safetensors").is_file()
    run_train(typed_cfg(*FAST, "heads=chained", "heads.k=3", "loss=ce"))  # other shapes: also afresh
    assert fits[-1] == (0, 4)


@pytest.mark.integration
def test_a_draft_vocabulary_is_chosen_from_the_data_and_saved_with_the_heads(typed_cfg, tmp_path):
    cfg = typed_cfg(*FAST, "heads=chained", "heads.k=2", "loss=kl", "heads.draft_vocab=48")
    run_train(cfg)
    saved = load_file(str(tmp_path / "out" / "heads.safetensors"))
    meta = json.loads((tmp_path / "out" / "heads.json").read_text())
    draft = saved["draft_ids"]
    assert meta["draft_size"] == len(draft) == 48 and meta["heads"]["draft_vocab"] == 48
    assert torch.equal(draft, draft.sort().values) and len(set(draft.tolist())) == 48
    from mtp_train.backbone import build_tiny_tokenizer

    assert build_tiny_tokenizer().eos_token_id in draft.tolist()  # the end of turn stays draftable
    run_train(typed_cfg(*FAST, "heads=chained", "heads.k=2", "heads.draft_vocab=100000",
                        f"paths.output_dir={tmp_path}/cap"))
    assert "draft_ids" not in load_file(str(tmp_path / "cap" / "heads.safetensors"))  # a cap: all 259


@pytest.mark.integration
def test_bf16_autocast_trains_with_a_draft_vocabulary(typed_cfg):
    cfg = typed_cfg(*FAST, "heads=chained", "heads.k=2", "loss=e2e_tv", "heads.draft_vocab=64",
                    "trainer.precision=bf16-mixed", "trainer.fast_dev_run=true")
    metrics = run_train(cfg)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.integration
def test_data_fraction_trains_on_the_first_rows_and_records_the_tokens(typed_cfg, tmp_path):
    from mtp_train.data.prepared import load_splits
    from mtp_train.layout import data_dirs
    from mtp_train.lit.data import first_fraction

    run_train(typed_cfg(*FAST, "heads=medusa", "heads.k=1", f"paths.output_dir={tmp_path}/all"))
    cfg = typed_cfg(*FAST, "heads=medusa", "heads.k=1", "train.data_fraction=0.25",
                    f"paths.output_dir={tmp_path}/quarter")
    run_train(cfg)
    full = json.loads((tmp_path / "all" / "heads.json").read_text())["recipe"]
    quarter = json.loads((tmp_path / "quarter" / "heads.json").read_text())["recipe"]
    sizes = []
    rows = load_splits(data_dirs(cfg), sizes)["train"]["input_ids"]
    keep = first_fraction([s["train"] for s in sizes], 0.25)  # the first quarter of each source
    assert quarter["train_rows"] == len(keep) < full["train_rows"] == len(rows)
    crop = cfg.train.max_length or cfg.data.max_length
    assert quarter["train_tokens"] == sum(min(len(rows[i]), crop) for i in keep) < full["train_tokens"]


@pytest.mark.integration
def test_a_data_fraction_of_mixed_data_takes_each_source_alike(typed_cfg, tmp_path):
    from mtp_train.data.prepared import load_splits
    from mtp_train.layout import data_dirs
    from mtp_train.lit.data import first_fraction

    assert first_fraction([8, 4], 0.25) == [0, 1, 8]
    assert first_fraction([8, 0, 3], 0.1) == [0, 8]  # at least one row of a non-empty part
    cfg = typed_cfg(*FAST, "heads=medusa", "heads.k=1", "train.data_use=mix", "train.data_fraction=0.5",
                    f"paths.output_dir={tmp_path}/half")
    run_train(cfg)
    sizes = []
    load_splits(data_dirs(cfg), sizes)
    half = json.loads((tmp_path / "half" / "heads.json").read_text())["recipe"]
    assert len(sizes) == 2 and half["train_rows"] == sum(round(0.5 * s["train"]) for s in sizes)


@pytest.mark.integration
def test_loss_schedule_switches_the_loss_part_way(typed_cfg):
    from types import SimpleNamespace

    from mtp_train.config import LossConfig, LossSchedule
    from mtp_train.lit.module import MTPHeadsModule

    lc = LossConfig(name="kl", schedule=LossSchedule(then="e2e_tv", at=0.5))
    assert [lc.name_at(s, 10) for s in (0, 4, 5, 9)] == ["kl", "kl", "e2e_tv", "e2e_tv"]
    assert LossConfig(name="kl").name_at(9, 10) == "kl"
    heads = torch.nn.Linear(2, 2)
    heads.k = 2
    module = MTPHeadsModule(None, heads, lc, typed_cfg(*FAST).train)
    for step, want in ((3, "kl"), (6, "e2e_tv")):  # the module reads the step from its trainer
        module._trainer = SimpleNamespace(max_steps=10, global_step=step)
        assert module.loss_name() == want
    # end to end: the switch and the top-K term train and log
    metrics = run_train(typed_cfg(*FAST, "loss=kl", "loss.schedule.then=e2e_tv", "loss.schedule.at=0.5",
                                  "loss.topk=4"))
    assert "val/loss_topk" in metrics and "val/sim_tau" in metrics


def test_weight_decay_skips_norms_and_biases_and_lr_schedules_have_their_shape(typed_cfg):
    from mtp_train.backbone import load_backbone
    from mtp_train.heads.persist import build_heads
    from mtp_train.lit.module import MTPHeadsModule
    from mtp_train.lit.schedule import lr_scheduler

    cfg = typed_cfg(*FAST, "heads=chained", "heads.k=2", "train.weight_decay=0.5")
    backbone = load_backbone(cfg.backbone)
    heads = build_heads(cfg.heads, backbone)
    module = MTPHeadsModule(backbone, heads, cfg.loss, cfg.train)
    decayed, plain = module.param_groups()
    names = {id(p): n for n, p in heads.named_parameters()}
    assert decayed["weight_decay"] == 0.5 and plain["weight_decay"] == 0.0
    assert plain["params"] and all(p.dim() == 1 for p in plain["params"])
    assert any("norm" in names[id(p)] for p in plain["params"])
    assert all(p.dim() >= 2 for p in decayed["params"])
    # with zero gradients AdamW only decays: matrices shrink, norms and biases stay
    opt = torch.optim.AdamW(module.param_groups(), lr=0.1)
    before = {id(p): p.detach().clone() for p in heads.parameters()}
    for p in heads.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in plain["params"]:
        assert torch.equal(p, before[id(p)])
    for p in decayed["params"]:
        torch.testing.assert_close(p, before[id(p)] * (1 - 0.1 * 0.5))

    # train.adam_betas reach the optimizer mtp-train builds
    from types import SimpleNamespace

    eagle = MTPHeadsModule(backbone, heads, cfg.loss, typed_cfg(*FAST, "train.adam_betas=[0.9,0.95]").train)
    eagle._trainer = SimpleNamespace(strategy=None, max_steps=10, estimated_stepping_batches=10)
    assert eagle.configure_optimizers()["optimizer"].defaults["betas"] == (0.9, 0.95)

    def lrs(schedule):
        tc = typed_cfg(*FAST, f"train.lr_schedule={schedule}", "train.warmup_steps=10", "train.lr=1.0",
                       "train.min_lr_ratio=0.1", "train.decay_fraction=0.2").train
        o = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched, out = lr_scheduler(o, tc, 100), []
        for _ in range(100):
            out.append(o.param_groups[0]["lr"])
            o.step()
            sched.step()
        return out

    cos, const, wsd = lrs("cosine"), lrs("constant"), lrs("wsd")
    for xs in (cos, const, wsd):
        assert xs[0] <= 0.1 and xs[:11] == sorted(xs[:11]) and xs[10] == pytest.approx(1.0)  # warm-up
    assert const[99] == 1.0
    assert all(x == pytest.approx(1.0) for x in wsd[10:80]) and wsd[99] < 0.15  # stable, then decay
    assert cos[50] < 1.0 and cos[99] == pytest.approx(0.1, abs=0.01)


@pytest.mark.bad_input
@pytest.mark.integration
def test_heads_deeper_than_every_row_are_refused_naming_heads_k(typed_cfg):
    from mtp_train.errors import ConfigError
    from mtp_train.layout import data_dirs
    from mtp_train.lit.data import MTPDataModule
    from tests.helpers import prepare_tiny

    cfg = typed_cfg(*FAST)
    prepare_tiny(cfg)
    from mtp_train.errors import DataError

    # 12 tokens are long enough for depth 10, but cropped there the rows are all prompt: named as
    # train.max_length's doing, not as rows without answers (hostile round 3)
    with pytest.raises(DataError, match=r"^train\.max_length=12: crops every answer token off the training rows"):
        MTPDataModule(data_dirs(cfg), 0, 4, 12, k=10).setup()
    with pytest.raises(ConfigError, match=r"^heads.k: 11 heads need rows of at least 13 tokens; the longest "
                                          r"training row has 12 \(rows cropped to 12\)"):
        MTPDataModule(data_dirs(cfg), 0, 4, 12, k=11).setup()


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_checkpoint_cut_off_while_saving_is_refused_with_the_way_out(typed_cfg, tmp_path):
    base = [*FAST, "heads=medusa", "heads.k=2", "loss=kl"]
    run_train(typed_cfg(*base))
    last = tmp_path / "out" / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a kill during the save
    with pytest.raises(MtpError, match=r"last.ckpt: cannot be read \(.*\); it was probably cut off while being "
                                       r"saved. Rerun with force=true to train afresh"):
        run_train(typed_cfg(*base, "trainer.max_steps=6"))
    metrics = run_train(typed_cfg(*base, "trainer.max_steps=6", "force=true"))
    assert "val/sim_tau" in metrics  # trained afresh, to the end, into a readable checkpoint:
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 6


@pytest.mark.integration
def test_a_checkpoint_holding_code_is_refused_on_resume_and_never_runs(typed_cfg, tmp_path, planted):
    base = [*FAST, "heads=medusa", "heads.k=2", "loss=kl"]
    run_train(typed_cfg(*base))
    last, (payload, marker) = tmp_path / "out" / "checkpoints" / "last.ckpt", planted
    ckpt = torch.load(last, map_location="cpu", weights_only=True)  # a file this test made
    ckpt["callbacks"] = {"x": payload}
    torch.save(ckpt, last)
    with pytest.raises(MtpError, match=r"last.ckpt: refusing to resume from it: .*could run code \(it names "):
        run_train(typed_cfg(*base, "trainer.max_steps=6"))
    assert not marker.exists()


@pytest.mark.integration
def test_export_reads_the_recipe_mtp_train_wrote_under_its_lock(typed_cfg, tmp_path):
    """Hydra's .hydra/config.yaml can be written over by a command refused on the same directory;
    the run's own run_config.yaml cannot."""
    from mtp_train.layout import RUN_CONFIG
    from mtp_train.pipeline.export import load_recipe

    run_train(typed_cfg(*FAST, "heads=medusa", "heads.k=2", "loss=kl"))
    run = tmp_path / "out"
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("heads:\n  k: 3\n")  # another command's
    assert (run / RUN_CONFIG).is_file() and load_recipe(run).heads.k == 2


@pytest.mark.bad_input
@pytest.mark.integration
def test_export_refuses_a_deeper_checkpoint_and_drops_another_runs_figures(typed_cfg, tmp_path):
    """A k=4 checkpoint exported into a k=3 run is refused (it used to keep depths 1-3 silently); a
    checkpoint from elsewhere keeps none of the run's own validation figures or tree statistics."""
    import shutil

    from mtp_train.layout import TREE_STATS
    from mtp_train.pipeline.export import export_heads

    run_train(typed_cfg(*FAST, "heads.k=3", f"paths.output_dir={tmp_path}/k3"))
    run_train(typed_cfg(*FAST, "heads.k=4", f"paths.output_dir={tmp_path}/k4"))
    with pytest.raises(MtpError, match=r"does not match heads=chained k=3 of .*run_config.yaml .*not in these "
                                       r"heads \['blocks.3"):
        export_heads(tmp_path / "k3", tmp_path / "k4" / "checkpoints" / "last.ckpt")
    shutil.copytree(tmp_path / "k3", tmp_path / "k3b")
    export_heads(tmp_path / "k3b", tmp_path / "k3" / "checkpoints" / "last.ckpt")  # not k3b's own
    meta = json.loads((tmp_path / "k3b" / "heads.json").read_text())
    assert set(meta["metrics"]) == {"exported_from"} and not (tmp_path / "k3b" / TREE_STATS).exists()
    assert meta["run"]["elapsed_s"] is None  # how long those weights trained is not known here
    trained = json.loads((tmp_path / "k3" / "heads.json").read_text())["run"]
    export_heads(tmp_path / "k3")  # its own last.ckpt: its figures stay, and its training time (hostile round 4)
    meta = json.loads((tmp_path / "k3" / "heads.json").read_text())
    assert "val/sim_tau" in meta["metrics"] and trained["elapsed_s"] > 0
    assert meta["run"]["elapsed_s"] == trained["elapsed_s"] and meta["run"]["world_size"] == trained["world_size"]


@pytest.mark.bad_input
@pytest.mark.integration
def test_export_from_last_ckpt_gives_the_finished_heads_and_never_older_weights_with_newer_figures(typed_cfg,
                                                                                                   tmp_path):
    """With max_steps not a multiple of the checkpoint interval, last.ckpt lagged the heads: the
    default export wrote step-4 weights under step-5 metrics and tree statistics (hostile round 5).
    Training now ends with a checkpoint of its final weights; a checkpoint at another step than
    the heads keeps none of their figures."""
    import shutil

    from mtp_train.layout import TREE_STATS
    from mtp_train.pipeline.export import checkpoint_step, export_heads

    run = tmp_path / "out"
    run_train(typed_cfg(*FAST, "heads.k=2", "trainer.max_steps=5", "trainer.val_check_interval=2"))
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 5
    heads = load_file(str(run / "heads.safetensors"))
    export_heads(run)
    again = load_file(str(run / "heads.safetensors"))
    assert all(torch.equal(heads[n], again[n]) for n in heads)
    assert "val/sim_tau" in json.loads((run / "heads.json").read_text())["metrics"]
    # an older checkpoint in last.ckpt's place (as before the fix): figures dropped, not mislabelled
    shutil.copy(run / "checkpoints" / "last.ckpt", tmp_path / "step5.ckpt")
    run_train(typed_cfg(*FAST, "heads.k=2", "trainer.max_steps=7", "trainer.val_check_interval=2"))
    shutil.copy(tmp_path / "step5.ckpt", run / "checkpoints" / "last.ckpt")
    export_heads(run)
    meta = json.loads((run / "heads.json").read_text())
    assert "val/sim_tau" not in meta["metrics"] and not (run / TREE_STATS).exists()


@pytest.mark.bad_input
@pytest.mark.integration
def test_export_of_a_checkpoint_from_a_run_on_other_backbone_weights_is_refused(typed_cfg, tmp_path):
    from mtp_train.errors import ConfigError
    from mtp_train.pipeline.export import export_heads

    run_train(typed_cfg(*FAST, "heads.k=2", f"paths.output_dir={tmp_path}/a"))
    run_train(typed_cfg(*FAST, "heads.k=2", "backbone.tiny.seed=1", f"paths.output_dir={tmp_path}/b"))
    with pytest.raises(ConfigError, match=r"last\.ckpt: trained on another backbone"):
        export_heads(tmp_path / "a", tmp_path / "b" / "checkpoints" / "last.ckpt")


@pytest.mark.bad_input
@pytest.mark.integration
def test_resuming_past_a_shorter_max_steps_is_refused(typed_cfg, tmp_path):
    run_train(typed_cfg(*FAST, "trainer.max_steps=6", "trainer.val_check_interval=3"))
    (tmp_path / "out" / "heads.json").unlink()  # so the run is resumed, not skipped as finished
    with pytest.raises(MtpError, match=r"^trainer.max_steps: .*last.ckpt is already at step 6, past the 4 "
                                       r"asked for; force=true trains 4 steps afresh"):
        run_train(typed_cfg(*FAST, "trainer.max_steps=4", "trainer.val_check_interval=2"))


@pytest.mark.bad_input
@pytest.mark.integration
def test_training_refuses_data_prepared_from_another_source(typed_cfg, tmp_path):
    from data_prep.stages import run_prep
    from mtp_train.errors import DataError

    rows = [{"messages": [{"role": "user", "content": f"Count to {i}."},
                          {"role": "assistant", "content": " ".join(map(str, range(1, i + 3)))}]} for i in range(30)]
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = ["data=jsonl", "data.name=mine", f"data.path={good}", "data.max_length=128",
            "data.distill.max_new_tokens=16", "train.data_use=labelled"]
    run_prep(dataclasses.replace(typed_cfg(*FAST, *data), stage="data"))
    other = tmp_path / "other.jsonl"
    other.write_text(good.read_text().replace("Count", "Recount"))
    with pytest.raises(DataError, match=r"labelled is missing or was built with other data settings; run "
                                        r"`mtp-prep stage=data`"):
        run_train(typed_cfg(*FAST, *[d if not d.startswith("data.path") else f"data.path={other}" for d in data]))
    assert not (tmp_path / "out" / "heads.safetensors").exists()


@pytest.mark.bad_input
@pytest.mark.integration
def test_prompt_only_rows_are_refused_instead_of_training_nothing(typed_cfg, tmp_path):
    from data_prep.stages import run_prep
    from mtp_train.errors import DataError

    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"Count to {i}."}) for i in range(30)) + "\n")
    data = ["data=jsonl", "data.name=p", f"data.path={src}", "data.max_length=128", "train.data_use=labelled"]
    run_prep(dataclasses.replace(typed_cfg(*FAST, *data), stage="data"))
    with pytest.raises(DataError, match=r"the training rows hold no answer token to learn from"):
        run_train(typed_cfg(*FAST, *data))
    assert not (tmp_path / "out" / "heads.safetensors").exists()


def test_every_heads_key_is_part_of_the_recipe(typed_cfg):
    """A changed heads setting is another recipe: the run trains afresh instead of resuming."""
    from mtp_train.pipeline.rundir import recipe_keys

    base = recipe_keys(typed_cfg(*FAST))[0]
    for change in ("heads.share=true", "heads.num_layers=2", "train.length_window=0"):
        assert recipe_keys(typed_cfg(*FAST, change))[0] != base, change
    # how a step runs, not what it computes: the same recipe, so a run resumes across it
    for same in ("train.compile=auto", "train.compile=on", "train.num_workers=1"):
        assert recipe_keys(typed_cfg(*FAST, same)) == recipe_keys(typed_cfg(*FAST)), same


@pytest.mark.bad_input
@pytest.mark.integration
def test_export_killed_while_writing_keeps_the_previous_heads_and_the_rerun_writes_them(typed_cfg, tmp_path,
                                                                                        monkeypatch):
    import safetensors.torch as st

    from mtp_train.pipeline.export import export_heads

    run_train(typed_cfg(*FAST, "heads=medusa", "heads.k=2", "loss=kl"))
    run = tmp_path / "out"
    before = (run / "heads.safetensors").read_bytes()

    def dying_save(state, path, *a, **k):
        open(path, "wb").write(b"half a file")  # the kill lands mid-write
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:
        m.setattr(st, "save_file", dying_save)
        with pytest.raises(KeyboardInterrupt):
            export_heads(run)
    assert (run / "heads.safetensors").read_bytes() == before  # the published file is untouched
    export_heads(run)
    assert load_file(str(run / "heads.safetensors")).keys() == st.load(before).keys()


def test_feature_noise_is_bounded_by_each_states_rms_and_only_in_training(typed_cfg):
    from mtp_train.backbone import load_backbone
    from mtp_train.heads.persist import build_heads
    from mtp_train.lit.module import MTPHeadsModule, with_noise

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16) * torch.linspace(0.1, 10, 5)[None, :, None]  # positions of very different scale
    y = with_noise(x, 0.2)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    d = (y - x).abs()
    assert (d <= 0.2 * rms + 1e-6).all() and (d > 0).float().mean() > 0.99
    assert (d.amax(-1) > 0.1 * rms[..., 0]).all()  # the noise fills its range, per position
    assert with_noise(x, 0.0) is x and with_noise(None, 0.3) is None
    # in a module: training steps see noised states, validation does not
    cfg = typed_cfg(*FAST, "heads=chained", "heads.k=2", "train.feature_noise=0.5")
    backbone = load_backbone(cfg.backbone)
    heads = build_heads(cfg.heads, backbone)
    module = MTPHeadsModule(backbone, heads, cfg.loss, cfg.train)
    module.log = lambda *a, **k: None
    ids = torch.randint(3, 200, (2, 12))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        val = [module.model_step(batch, "val") for _ in range(2)]
        train = [module.model_step(batch, "train") for _ in range(2)]
    assert torch.equal(val[0], val[1]) and not torch.equal(train[0], train[1])


@pytest.mark.integration
def test_a_longer_resumed_run_schedules_its_learning_rate_over_the_new_length(typed_cfg, tmp_path):
    """The scheduler's state in a checkpoint carries the length it ran over (LrShape.total); resuming
    with a larger trainer.max_steps must run the cosine over the new length, ending at min_lr_ratio
    (with the old length restored, step 14 of a 4-step cosine is back at the full rate)."""
    base = [*FAST, "heads=chained", "heads.k=2", "train.warmup_steps=2", "train.lr=1e-3", "train.min_lr_ratio=0.1"]
    run_train(typed_cfg(*base))
    run_train(typed_cfg(*base, "trainer.max_steps=14"))
    ckpt = torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 14 and ckpt["lr_schedulers"][0]["lr_lambdas"][0]["total"] == 14
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-4)


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_refused_run_leaves_the_finished_run_in_place(typed_cfg, tmp_path):
    """A changed recipe supersedes the finished run only once the new run's checks have passed: a
    command refused for its data settings must not move the finished heads aside (hostile round 5)."""
    from mtp_train.layout import SUPERSEDED

    run_train(typed_cfg(*FAST, "heads.k=2"))
    heads = (tmp_path / "out" / "heads.safetensors").read_bytes()
    with pytest.raises(MtpError, match="other data settings|missing"):
        from mtp_train.pipeline.training import (
            run_train as train_only,  # no preparation: the data differ
        )

        train_only(typed_cfg(*FAST, "heads.k=3", "data.max_length=64"))
    assert (tmp_path / "out" / "heads.safetensors").read_bytes() == heads
    assert not (tmp_path / "out" / SUPERSEDED).exists()
    assert run_train(typed_cfg(*FAST, "heads.k=2"))  # still finished: skipped


def test_trainer_keys_that_change_the_weights_are_part_of_the_recipe(typed_cfg):
    """Other clipping, accumulation, a part of each epoch or another number of processes train other
    weights: not "the same recipe" (hostile round 5); logging keys are not part of it, and the
    defaults leave recipes from before this rule unchanged."""
    from mtp_train.pipeline.rundir import recipe_keys

    base = recipe_keys(typed_cfg(*FAST))
    for other in ("+trainer.accumulate_grad_batches=4", "trainer.gradient_clip_val=0.001",
                  "trainer.limit_train_batches=0.25", "trainer.devices=2"):
        assert recipe_keys(typed_cfg(*FAST, other))[0] != base[0], other
    for same in ("trainer.log_every_n_steps=7", "trainer.enable_progress_bar=true", "trainer.gradient_clip_val=1",
                 "trainer.val_check_interval=3"):
        assert recipe_keys(typed_cfg(*FAST, same)) == base, same


@pytest.mark.bad_input
@pytest.mark.integration
def test_rows_distilled_with_other_settings_or_by_another_backbone_are_refused(typed_cfg, tmp_path):
    """mtp-train trained on rows distilled with max_new_tokens 16 when told 4, and on another tiny
    backbone's "self"-distilled answers (hostile round 5): each refused naming what differs."""
    from mtp_train.errors import DataError
    from mtp_train.pipeline.training import run_train as train_only
    from tests.helpers import prepare_tiny

    prepare_tiny(typed_cfg(*FAST, "heads.k=2"))
    with pytest.raises(DataError, match=r"data\.distill\.max_new_tokens: .* was distilled with \d+, this run says 4"):
        train_only(typed_cfg(*FAST, "heads.k=2", "data.distill.max_new_tokens=4"))
    prepare_tiny(typed_cfg(*FAST, "heads.k=2", "backbone.tiny.seed=1"))  # rewrites the same distilled rows
    with pytest.raises(DataError, match="was distilled by another backbone than this one"):
        train_only(typed_cfg(*FAST, "heads.k=2"))
    assert not (tmp_path / "out" / "heads.safetensors").exists()


@pytest.mark.bad_input
def test_a_planted_yaml_tag_in_the_run_config_is_one_line_and_never_runs(tmp_path):
    from mtp_train.pipeline.export import load_recipe

    (tmp_path / "run_config.yaml").write_text(f"seed: !!python/object/apply:os.system ['touch {tmp_path}/ran']\n")
    with pytest.raises(MtpError, match=r"run_config\.yaml: not a config mtp-train wrote"):
        load_recipe(tmp_path)
    assert not (tmp_path / "ran").exists()


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_checkpoint_of_other_heads_without_its_run_record_is_refused_in_one_line(typed_cfg, tmp_path):
    """A k=2 last.ckpt in a directory without run_meta.json, resumed as k=3, ended in Lightning's
    load_state_dict traceback (hostile round 5)."""
    import shutil

    from mtp_train.errors import ConfigError
    from mtp_train.pipeline.training import run_train as train_only

    run_train(typed_cfg(*FAST, "heads.k=2", f"paths.output_dir={tmp_path}/a"))
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    with pytest.raises(ConfigError, match=r"last\.ckpt holds other heads than these \(parameters \["):
        train_only(typed_cfg(*FAST, "heads.k=3", f"paths.output_dir={tmp_path}/b"))


@pytest.mark.parametrize("split", ["train", "val"])
def test_train_steps_estimate_alpha_on_strided_positions_and_validation_on_all(split):
    """train/alpha_d* reads every TRAIN_ALPHA_STRIDE-th position (a tenth of a step saved on the demo's
    heads); val/alpha_d* reads every one. Both against the obvious mean of acceptance()."""
    from types import SimpleNamespace

    from mtp_train.lit.module import TRAIN_ALPHA_STRIDE, MTPHeadsModule
    from mtp_train.losses import LossOutput, acceptance

    g = torch.Generator().manual_seed(0)
    n, k, v = 5 * TRAIN_ALPHA_STRIDE + 3, 2, 16
    logits = torch.randn(1, n, k, v, generator=g) * 2
    teacher = torch.log_softmax(torch.randn(1, n, k, v, generator=g) * 2, -1)
    valid = torch.rand(1, n, k, generator=g) > 0.2
    logged = {}
    fake = SimpleNamespace(heads=SimpleNamespace(to_tokens=lambda t: t), k=k, _val_chain=[], _val_sampled={},
                           train_alpha_stride=TRAIN_ALPHA_STRIDE,
                           train_cfg=SimpleNamespace(sampled_tau_temperatures=[]),
                           log=lambda name, value, **kw: logged.__setitem__(name, float(value)))
    out = LossOutput(loss=torch.tensor(0.0), per_depth=torch.zeros(k))
    tokens = torch.zeros(1, n, k, dtype=torch.long)
    MTPHeadsModule._log_metrics(fake, split, out, logits, teacher, tokens, tokens, valid)
    alpha = acceptance(logits, teacher, teacher_logprobs=True)
    every = range(0, n, TRAIN_ALPHA_STRIDE) if split == "train" else range(n)
    for j in range(k):
        pairs = [(alpha[0, t, j].item(), valid[0, t, j].item()) for t in every]
        expected = sum(a for a, ok in pairs if ok) / max(1, sum(ok for _, ok in pairs))
        assert logged[f"{split}/alpha_d{j + 1}"] == pytest.approx(expected, rel=1e-5)
    full = (alpha[0, :, 0] * valid[0, :, 0]).sum().item() / valid[0, :, 0].sum().item()
    assert (logged[f"{split}/alpha_d1"] == pytest.approx(full, rel=1e-5)) == (split == "val")
