"""Leaving one process: rank-split data, 2-process DDP on CPU against one process, trainer checks,
the DeepSpeed config against DeepSpeed's own parser, and consolidation of a real ZeRO checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
import torch
from safetensors.torch import load_file

from mtp_train.distributed import (
    check_trainer,
    deepspeed_config,
    heads_from_module_state,
    validate_deepspeed_config,
)
from mtp_train.errors import ConfigError
from mtp_train.lit.data import RankSlice, ResumableSampler
from tests.helpers import prep_cli

BIN = Path(sys.executable).parent
TINY = ["backbone=tiny", "logger=csv", "trainer.max_steps=10", "trainer.val_check_interval=5",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "heads.k=2",
        "loss=kl", "data.val_fraction=0.05"]  # the split the DDP tolerance below was measured on


# --- data split by rank --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [17, 20])
def test_rank_batches_together_are_the_one_process_batches(n):
    single = list(ResumableSampler(n, seed=3))
    ranks = [list(ResumableSampler(n, seed=3, rank=r, world=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == n // 2  # equal batch counts: no rank waits forever
    b = 2  # per rank; the one-process run uses 2 * b
    for s in range(len(ranks[0]) // b):
        together = sorted(ranks[0][s * b:(s + 1) * b] + ranks[1][s * b:(s + 1) * b])
        assert together == sorted(single[s * 2 * b:(s + 1) * 2 * b])
    assert not set(ranks[0]) & set(ranks[1])


def _lengths(n, seed=0):
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("n", [37, 40])
def test_grouped_rank_batches_together_are_the_one_process_batches(n):
    lengths, b = _lengths(n), 2
    single = list(ResumableSampler(n, seed=3, lengths=lengths, batch=2 * b, window=4))
    ranks = [list(ResumableSampler(n, seed=3, rank=r, world=2, lengths=lengths, batch=b, window=4))
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == n // 2
    # windows of 4 global batches (16 rows); when n is odd the last one differs by the row that
    # two processes leave out
    for s in range(len(ranks[0]) // b if n % 2 == 0 else n // 16 * 4):
        together = sorted(ranks[0][s * b:(s + 1) * b] + ranks[1][s * b:(s + 1) * b])
        assert together == sorted(single[s * 2 * b:(s + 1) * 2 * b])


def test_grouped_batches_are_length_sorted_slices_of_each_window():
    n, batch, window = 50, 4, 3
    lengths = _lengths(n, seed=1)
    plain = list(ResumableSampler(n, seed=5))
    grouped = list(ResumableSampler(n, seed=5, lengths=lengths, batch=batch, window=window))
    assert sorted(grouped) == sorted(plain) == list(range(n))  # the same rows, each once
    span = batch * window
    for w in range(0, n, span):  # each window of the plain permutation keeps its rows
        assert sorted(grouped[w:w + span]) == sorted(plain[w:w + span])
        by_length = sorted(plain[w:w + span], key=lambda i: -lengths[i])
        slices = [sorted(by_length[s:s + batch]) for s in range(0, len(by_length), batch)]
        batches = [sorted(grouped[s:s + batch]) for s in range(w, min(w + span, n), batch)]
        assert sorted(batches) == sorted(slices)  # every batch is one slice of the sorted window
    assert grouped != plain

    def padded(order):  # slots of right-padded batches
        return sum(batch * max(lengths[i] for i in order[s:s + batch]) for s in range(0, n, batch))
    assert padded(grouped) < 0.9 * padded(plain)


def test_grouping_off_is_the_plain_permutation():
    lengths = _lengths(30)
    plain = list(ResumableSampler(30, seed=2))
    for window in (0, 1):
        assert list(ResumableSampler(30, seed=2, lengths=lengths, batch=4, window=window)) == plain


def test_grouped_sampler_resume_skips_this_ranks_rows():
    lengths = _lengths(40)
    kw = dict(seed=1, rank=1, world=2, lengths=lengths, batch=3, window=4)
    full = list(ResumableSampler(40, **kw))
    s = ResumableSampler(40, **kw)
    s.skip = 6
    assert list(s) == full[6:]


def test_rank_sampler_resume_skips_this_ranks_rows():
    full = list(ResumableSampler(20, seed=1, rank=1, world=2))
    s = ResumableSampler(20, seed=1, rank=1, world=2)
    s.skip = 4
    assert list(s) == full[4:]
    assert list(s) == full  # the skip applies once


def test_validation_slices_are_disjoint_and_equal_per_rank():
    parts = [list(RankSlice(11, r, 3)) for r in range(3)]
    assert sorted(sum(parts, [])) == list(range(9))  # 11 - 11 % 3: every rank runs 3 rows
    assert {len(p) for p in parts} == {3}
    assert list(RankSlice(11)) == list(range(11))  # one process: every row


# --- trainer checks ------------------------------------------------------------------------------

@pytest.mark.bad_input
def test_trainer_checks_name_the_key():
    with pytest.raises(ConfigError, match="trainer.strategy.*CUDA"):
        check_trainer({"max_steps": 10, "accelerator": "cpu", "devices": 1, "strategy": {
            "_target_": "lightning.pytorch.strategies.DeepSpeedStrategy"}}, gpus=0)
    with pytest.raises(ConfigError, match="trainer.strategy"):
        check_trainer({"max_steps": 10, "accelerator": "gpu", "devices": "auto", "strategy": "deepspeed_stage_2"}, gpus=0)
    with pytest.raises(ConfigError, match="trainer.devices: 8 GPUs asked, 2 visible"):
        check_trainer({"max_steps": 10, "accelerator": "gpu", "devices": 8, "strategy": "ddp"}, gpus=2)
    with pytest.raises(ConfigError, match="trainer.devices: 64 CPU processes"):
        check_trainer({"max_steps": 10, "accelerator": "cpu", "devices": 64, "strategy": "ddp"}, gpus=0, cpus=2)
    with pytest.raises(ConfigError, match="trainer.accelerator"):
        check_trainer({"max_steps": 10, "accelerator": "gpu", "devices": 1}, gpus=0)
    with pytest.raises(ConfigError, match="inside a local multirun"):
        check_trainer({"max_steps": 10, "accelerator": "cpu", "devices": 2, "strategy": "ddp"}, gpus=0, cpus=2,
                      multirun=True)
    check_trainer({"max_steps": 10, "accelerator": "cpu", "devices": 2, "strategy": "ddp"}, gpus=0, cpus=2)
    check_trainer({"max_steps": 10, "accelerator": "gpu", "devices": 8, "strategy": "deepspeed"}, gpus=8)
    for steps in (0, -5):  # would write untrained heads
        with pytest.raises(ConfigError, match=rf"trainer.max_steps: {steps} trains nothing"):
            check_trainer({"accelerator": "cpu", "max_steps": steps}, gpus=0)
    with pytest.raises(ConfigError, match="trainer.max_epochs: 0 trains nothing"):
        check_trainer({"accelerator": "cpu", "max_steps": -1, "max_epochs": 0}, gpus=0)
    check_trainer({"accelerator": "cpu", "max_steps": -1, "max_epochs": 2}, gpus=0)
    check_trainer({"accelerator": "cpu", "max_steps": -1, "max_time": "00:04:00:00"}, gpus=0)  # a time budget
    with pytest.raises(ConfigError, match="Lightning would then train 1000 epochs"):
        check_trainer({"accelerator": "cpu", "max_steps": -1}, gpus=0)


@pytest.mark.bad_input
@pytest.mark.integration
def test_mtp_train_refuses_deepspeed_on_cpu_with_one_line(tmp_path):
    r = subprocess.run([str(BIN / "mtp-train"), *TINY, "trainer=deepspeed_stage_2",
                        f"paths.root_dir={tmp_path}", f"hydra.run.dir={tmp_path}/run"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "error: trainer.strategy" in r.stderr and "Traceback" not in r.stderr


# --- DeepSpeed config ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,stage,offload", [("deepspeed_stage_2", 2, False),
                                                ("deepspeed_stage_3", 3, False),
                                                ("deepspeed_stage_3_offload", 3, True)])
def test_composed_deepspeed_configs_parse_with_deepspeed(compose_cfg, name, stage, offload):
    cfg = compose_cfg(f"trainer={name}", "train.batch_size=6",
                      "trainer.strategy.config.reduce_bucket_size=5e8")
    assert cfg.trainer.strategy._target_ == "lightning.pytorch.strategies.DeepSpeedStrategy"
    ds = hydra.utils.instantiate(cfg.trainer.strategy.config)
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage and zero["reduce_bucket_size"] == 500_000_000
    assert ds["train_micro_batch_size_per_gpu"] == 6
    assert "bf16" not in ds and "fp16" not in ds  # Lightning writes it from trainer.precision
    assert ("offload_optimizer" in zero) == offload and ("offload_param" in zero) == offload
    validate_deepspeed_config(ds)  # DeepSpeed's own parser accepts it


@pytest.mark.bad_input
def test_deepspeed_config_refusals():
    with pytest.raises(ConfigError, match="offload_parameters"):
        deepspeed_config(stage=2, offload_parameters=True)
    with pytest.raises(ConfigError, match="stage 5"):
        deepspeed_config(stage=5)
    with pytest.raises(ConfigError, match="DeepSpeed rejects"):
        validate_deepspeed_config({"zero_optimization": {"stage": 2}, "train_batch_size": 3,
                                   "train_micro_batch_size_per_gpu": 2})


def test_deepspeeds_own_records_load_under_the_weights_only_rule(tmp_path):
    """What DeepSpeed's optimizer shards hold besides tensors (loss scalers of bf16/fp32 and fp16
    runs, ZeRO's stage enum, fragment addresses) passes; anything else would not."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from mtp_train.distributed import weights_only_loads, zero_file_types

    path = tmp_path / "optim.pt"
    records = {"static": LossScaler(4.0), "dynamic": DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1,
                                                                delayed_shift=2, consecutive_hysteresis=False),
               "stage": ZeroStageEnum.gradients, "where": fragment_address(numel=4, start=8), "t": torch.ones(2)}
    torch.save(records, path)
    with weights_only_loads(zero_file_types()):
        back = torch.load(path, weights_only=False)  # the caller's False is overruled, and it still loads
    assert back["dynamic"].cur_scale == 2.0 ** 16 and back["static"].cur_scale == 4.0
    assert back["stage"] == ZeroStageEnum.gradients and back["where"].start == 8
    with pytest.raises(Exception, match="GLOBAL"), weights_only_loads([]):
        torch.load(path, weights_only=False)


@pytest.mark.bad_input
@pytest.mark.parametrize("where", ["model", "optim"])
def test_a_planted_pickle_in_a_zero_checkpoint_is_refused_and_never_runs(tmp_path, where, planted):
    """The layout DeepSpeed reads (`latest` naming a tag, per-rank files under it) with a payload in
    one file: export refuses it with the object's name, and the payload never runs."""
    from mtp_train.errors import MtpError
    from mtp_train.pipeline.export import checkpoint_state

    ckpt, (payload, marker) = tmp_path / "last.ckpt", planted
    (ckpt / "tag").mkdir(parents=True)
    (ckpt / "latest").write_text("tag")
    model = {"module": {"w": torch.zeros(2)}, "buffer_names": [], "param_shapes": [{"w": torch.Size([2])}],
             "shared_params": {}, "ds_version": "0.19"}
    optim = {"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1}}
    (model if where == "model" else optim)["extra"] = payload
    torch.save(model, ckpt / "tag" / "mp_rank_00_model_states.pt")
    torch.save(optim, ckpt / "tag" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(MtpError, match=r"last\.ckpt: refusing to load .*could run code \(it names \w+"):
        checkpoint_state(ckpt)
    assert not marker.exists()


def test_heads_from_module_state_strips_any_wrapper_prefix():
    t = torch.zeros(1)
    state = {"_forward_module.heads.blocks.0.w": t, "heads.draft_ids": t, "module.other.w": t,
             "myheads.x": t}
    assert set(heads_from_module_state(state)) == {"blocks.0.w", "draft_ids"}


# --- runs ----------------------------------------------------------------------------------------

def _train(tmp_path, run, *overrides, timeout=900):
    prep_cli(*TINY, f"paths.root_dir={tmp_path}", *overrides, cwd=tmp_path)
    r = subprocess.run([str(BIN / "mtp-train"), *TINY, f"paths.root_dir={tmp_path}",
                        f"hydra.run.dir={tmp_path / run}", *overrides],
                       capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / run / "heads.json").read_text())["metrics"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return root, _train(root, "single", "train.batch_size=4")


@pytest.mark.integration
def test_ddp_two_processes_match_one_process_with_the_same_global_batch(single_run):
    """Same rows per global step, gradients averaged over ranks: the heads and the figures agree with
    the one-process run up to the difference between a mean of per-rank means and a global mean
    (ranks see different numbers of target positions). Tolerance: 2e-3 absolute on every weight
    after 10 steps at lr 1e-3 (a different data split moves them by about 1e-2)."""
    root, single = single_run
    ddp = _train(root, "ddp", "trainer=ddp", "trainer.devices=2", "train.batch_size=2")
    a, b = load_file(str(root / "single" / "heads.safetensors")), load_file(str(root / "ddp" / "heads.safetensors"))
    assert a.keys() == b.keys()
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff < 2e-3, diff
    assert abs(ddp["val/sim_tau"] - single["val/sim_tau"]) < 0.02
    assert abs(ddp["val/loss"] - single["val/loss"]) < 0.01 * abs(single["val/loss"]) + 1e-4
    # one writer: rank 1 logs to its own file, all artifacts come from rank 0 once
    run = root / "ddp"
    assert (run / "train_ddp_process_1.log").is_file()
    assert len(list((run / "csv").rglob("metrics.csv"))) == 1
    assert (run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.integration
def test_ddp_to_a_time_budget_trains_rank_0s_plan_on_every_rank(single_run):
    """Each rank times its own steps; if each followed its own plan, one would stop while the other
    waits in an all-reduce forever. Rank 0's plan is broadcast: the run ends, both ranks at the
    same step."""
    root, _ = single_run
    _train(root, "ddp-budget", "trainer=ddp", "trainer.devices=2", "train.batch_size=2", "train.time_budget_min=0.15",
           "train.min_steps=12", "trainer.max_steps=3000", "trainer.val_check_interval=25", timeout=400)
    meta = json.loads((root / "ddp-budget" / "heads.json").read_text())
    b = meta["recipe"]["budget"]
    assert b["steps"] == b["planned"] == meta["recipe"]["steps"] and 12 <= b["steps"] < 3000
    log1 = (root / "ddp-budget" / "train_ddp_process_1.log").read_text()
    assert "Error" not in log1


@pytest.mark.integration
def test_ddp_reduces_the_lora_adapters_too(tmp_path):
    """With backbone.lora the adapters train in every rank; DDP must average their gradients as it
    does the heads' (they are registered in the LightningModule), or rank 0's adapters would follow
    its own half of each batch. Control: one process trained on half-size batches, which is what
    rank 0 alone would learn; DDP's adapters must sit far closer to the full-batch run than that."""
    lora = ["backbone.lora.enabled=true", "backbone.lora.r=4"]
    _train(tmp_path, "single", "train.batch_size=4", *lora)
    _train(tmp_path, "half", "train.batch_size=2", *lora)
    _train(tmp_path, "ddp", "trainer=ddp", "trainer.devices=2", "train.batch_size=2", *lora)

    def diff(run, name):
        a, b = (load_file(str(tmp_path / r / name)) for r in ("single", run))
        assert a.keys() == b.keys()
        return max((a[k].float() - b[k].float()).abs().max().item() for k in a)

    assert diff("ddp", "heads.safetensors") < 2e-3
    adapters = "adapter/adapter_model.safetensors"
    assert diff("ddp", adapters) < 0.25 * diff("half", adapters), (diff("ddp", adapters), diff("half", adapters))


@pytest.mark.integration
def test_export_consolidates_a_zero_checkpoint_made_by_deepspeed(single_run, tmp_path):
    """DeepSpeed (on CPU, DS_ACCELERATOR=cpu) trains one step of these heads under ZeRO-2 and saves
    shards the way Lightning does (tag 'checkpoint', `_forward_module.` prefix); mtp-export-heads
    turns them back into exactly the engine's weights."""
    root, _ = single_run
    run = tmp_path / "run"
    shutil.copytree(root / "single", run)
    (run / "heads.safetensors").unlink()
    expected = tmp_path / "expected.safetensors"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MTP_ROOT": str(root)}
    script = Path(__file__).parent / "deepspeed_cpu_checkpoint.py"
    r = subprocess.run([sys.executable, str(script), str(run), str(tmp_path / "zero"), str(expected)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "zero" / "checkpoint").is_dir()
    r = subprocess.run([str(BIN / "mtp-export-heads"), str(run), "--checkpoint", str(tmp_path / "zero")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = load_file(str(run / "heads.safetensors")), load_file(str(expected))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    trained = load_file(str(root / "single" / "heads.safetensors"))
    assert any(not torch.equal(trained[k], want[k]) for k in want)  # the DeepSpeed step changed them
    meta = json.loads((run / "heads.json").read_text())
    assert meta["k"] == 2 and "exported_from" in meta["metrics"]
    # a file that is no checkpoint is refused with its name
    r = subprocess.run([str(BIN / "mtp-export-heads"), str(run), "--checkpoint", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "none: no checkpoint here" in r.stderr


@pytest.mark.bad_input
def test_a_checkpoint_write_that_fails_midway_keeps_the_previous_one_whole(tmp_path, monkeypatch):
    """A full disk while writing last.ckpt: the previous checkpoint is still there, byte for byte,
    and no temporary is left (Lightning's own writer moves a temp from /tmp: a copy that truncates)."""
    import errno

    import torch

    from mtp_train.distributed import trainer_plugins

    (io,) = trainer_plugins({"max_steps": 5})["plugins"]
    last = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, last)
    good = last.read_bytes()
    real_save = torch.save

    def disk_full(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, last)
    monkeypatch.setattr(torch, "save", real_save)
    assert last.read_bytes() == good and sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
    assert torch.load(last, weights_only=True)["step"] == 1
    io.save_checkpoint({"step": 3}, last)  # and the next good write replaces it
    assert torch.load(last, weights_only=True)["step"] == 3
    assert trainer_plugins({"strategy": "deepspeed_stage_2"}) == {}  # DeepSpeed writes its own directory
