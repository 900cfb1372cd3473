"""Sweeps: a failing point does not stop a local sweep, the report shows it; a 2 x 2 sweep over
heads.k and loss runs on a real one-node Slurm through Hydra's submitit launcher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mtp_train.sweep import gather, markdown_table
from tests.helpers import prep_cli, wandb_offline_runs

BIN = Path(sys.executable).parent
POINT = ["debug=smoke"]  # a logger= in a test's overrides replaces the overlay's none


def _sweep(tmp_path, *overrides, env=None, timeout=900):
    prep_cli(*POINT, f"paths.root_dir={tmp_path}", cwd=tmp_path)
    return subprocess.run([str(BIN / "mtp-train"), "-m", *POINT, f"paths.root_dir={tmp_path}",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


EVAL_AFTER = ["train.eval_after=true", "eval.n_prompts=2", "eval.max_new_tokens=6", "eval.modes=[verify]",
              "eval.rounds=1", "eval.warmup=0"]


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_local_sweep_names_groups_and_tags_its_points_and_summarises_them_failed_included(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    env = {**os.environ, "WANDB_SILENT": "true"}
    # the k=300 points fail (k longer than the rows); every point is decoded after training
    r = _sweep(tmp_path, "heads.k=300,2", "loss=ce,kl", "logger=[csv,wandb]", *EVAL_AFTER, env=env)
    # the other points ran, but a sweep with failed points does not pass: exit 1, the points named
    assert r.returncode == 1, r.stderr[-2000:]
    assert "error: 2 sweep point(s) failed" in r.stderr and "0-k300-ce" in r.stderr and "2-k2-ce" not in r.stderr
    sweep = tmp_path / "sweep"
    names = ["k300-ce", "k300-kl", "k2-ce", "k2-kl"]  # the swept values, in command-line order
    assert sorted(p.name for p in sweep.iterdir() if (p / ".hydra").is_dir()) == \
        sorted(f"{i}-{n}" for i, n in enumerate(names))
    # the summary was written when the multirun ended, without anyone asking
    out = json.loads((sweep / "sweep_report.json").read_text())
    rows = out["points"]
    assert [x["status"] for x in rows] == ["failed", "failed", "ok", "ok"]
    assert "heads.k" in rows[0]["error"] and rows[0]["overrides"]["heads.k"] == "300"
    assert out["failed"] == 2 and out["ok"] == 2 and out["swept"] == ["heads.k", "loss"]
    for x in rows[2:]:
        assert x["sim_tau"] >= 1.0 and len(x["acc"]) == 2 and all(0 <= a <= 1 for a in x["acc"])
        assert x["decoded"]["verify"]["tau"] >= 1.0 and x["decoded"]["verify"]["identical_to_greedy"]
        assert (Path(x["dir"]) / "eval" / "eval_report.json").is_file()
    assert Path(out["plot"]).stat().st_size > 1000
    table = (sweep / "sweep_report.md").read_text()
    assert table.count("failed: ConfigError: heads.k") == 2 and "verify tau / speedup" in table
    # W&B: each trained point's train and eval runs carry its name, the sweep's group and its tags;
    # the failed points made no run; the summary is a `sweep` job in the same group
    group = "default-sweep"  # <experiment_name>-sweep
    for i, name in enumerate(names[2:], start=2):
        point = sweep / f"{i}-{name}"
        assert (point / "csv" / name / "version_0" / "metrics.csv").is_file()  # the same name on disk
        runs = sorted(wandb_offline_runs(point), key=lambda x: x["job_type"])
        k, loss = name[1:].split("-")
        assert [(x["job_type"], x["name"], x["group"], x["tags"]) for x in runs] == \
            [(job, name, group, [f"heads.k={k}", f"loss={loss}"]) for job in ("eval", "train")]
    for i, name in enumerate(names[:2]):
        assert wandb_offline_runs(sweep / f"{i}-{name}") == []
    (summary,) = wandb_offline_runs(sweep / "wandb")
    assert (summary["job_type"], summary["group"], summary["name"]) == ("sweep", group, f"{group}-summary")
    blob = b"".join(f.read_bytes() for f in (sweep / "wandb").rglob("*.wandb"))
    assert b"sweep/summary" in blob and b"sweep/plot" in blob
    r = subprocess.run([sys.executable, "bench/sweep_report.py", str(sweep)],
                       capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert r.returncode == 1 and "2 ok, 2 failed" in r.stdout


@pytest.mark.bad_input
def test_report_refuses_a_directory_without_points(tmp_path):
    from mtp_train.errors import MtpError

    with pytest.raises(MtpError, match="no sweep points"):
        gather(tmp_path)


def test_a_sweep_summary_lists_this_multiruns_points_not_older_ones_in_a_reused_directory(tmp_path):
    """A sweep run into a directory that held another sweep's points summarised those too (hostile
    round 2): the summary after a multirun takes the points it ran (`since`); `bench/sweep_report.py`
    on a directory still lists every point there."""
    import time

    for name in ("0-k3-ce", "1-k2-kl"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text("- heads.k=2\n")
    hour_ago = time.time() - 3600
    os.utime(tmp_path / "0-k3-ce" / ".hydra" / "overrides.yaml", (hour_ago, hour_ago))
    assert [r["point"] for r in gather(tmp_path)] == ["0-k3-ce", "1-k2-kl"]
    assert [r["point"] for r in gather(tmp_path, since=time.time() - 60)] == ["1-k2-kl"]



def test_a_multirun_dates_its_start_by_the_sweep_directorys_clock(tmp_path, monkeypatch):
    """The points' files are dated by the filesystem's clock (a file server's under Slurm on NFS);
    a start read from this machine's clock, ahead of it, dropped every new point from the summary
    and from the failed points (exit 0 after a failure). The start is a file's date in the sweep dir."""
    import time

    from omegaconf import OmegaConf

    from mtp_train.cli.sweep import MULTIRUN_STARTED, SweepSummary

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600)  # this machine 10 minutes ahead
    cb = SweepSummary()
    cb.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))
    marker = tmp_path / "sweep" / MULTIRUN_STARTED
    assert marker.is_file() and cb._started == marker.stat().st_mtime and cb._started < real() + 5


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_sweep_whose_points_would_share_one_directory_is_refused(tmp_path):
    """hydra.sweep.subdir without the job number put every point in one directory, each superseding
    the one before (hostile round 2): refused before any point runs."""
    r = subprocess.run([str(BIN / "mtp-train"), "-m", "debug=smoke", "heads.k=2,3", "hydra.sweep.subdir=same",
                        f"hydra.sweep.dir={tmp_path}/sweep", f"paths.root_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().startswith("error: hydra.sweep.subdir=same: the sweep's points would share one "
                                       "directory") and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert not (tmp_path / "sweep" / "same").exists()
    # a subdir naming some swept keys: the wiring reads the sweep's own overrides (hostile round 4 refused
    # k${heads.k} for a sweep over heads.k alone; subdir_unnamed is tested on its own below)
    r = subprocess.run([str(BIN / "mtp-train"), "-m", "debug=smoke", "heads.k=2,3", "loss=ce,kl",
                        "hydra.sweep.subdir=k${heads.k}", f"hydra.sweep.dir={tmp_path}/sweep2",
                        f"paths.root_dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "(it does not name loss)" in r.stderr, r.stderr[-2000:]


def test_a_subdir_that_names_every_swept_key_is_distinct():
    """hostile round 4: `hydra.sweep.subdir=k${heads.k}` gives each point its own directory but was refused
    because it did not name the job number; a subdir is checked against the keys the sweep varies."""
    from mtp_train.cli.sweep import subdir_unnamed

    assert subdir_unnamed("k${heads.k}", ["heads.k"]) == []
    assert subdir_unnamed("${mtp_point_dir:${hydra.job.num}}", ["heads.k", "loss"]) == []
    assert subdir_unnamed("${hydra.job.override_dirname}", ["heads.k"]) == []
    assert subdir_unnamed("${hydra.runtime.choices.loss}-${heads.k}", ["loss", "heads.k"]) == []
    assert subdir_unnamed("${loss.name}", ["loss"]) == []  # a key under a swept group
    assert subdir_unnamed("k${heads.k}", ["heads.k", "train.lr"]) == ["train.lr"]
    assert subdir_unnamed("same", ["heads.k"]) == ["heads.k"]
    assert subdir_unnamed("${now:%H-%M}", ["heads.k"]) == ["heads.k"]  # a resolver call names no point
    assert subdir_unnamed("k${heads.kk}", ["heads.k"]) == ["heads.k"]
    assert subdir_unnamed("same", []) == []  # nothing swept: a single point


def test_point_names_come_from_the_swept_values():
    from mtp_train.cli.sweep import point_values
    from mtp_train.tracking import MAX_NAME, point_name

    groups = {"loss", "heads", "backbone"}
    values = point_values(["backbone=tiny", "heads.k=3", "loss=kl", "train.lr=0.001", "loss.adamtp=false",
                           "train.data_use=mix", "+extra.flag=true"],
                          ["heads.k", "loss", "train.lr", "loss.adamtp", "train.data_use", "extra.flag"])
    assert point_name(values, groups) == "k3-kl-lr0.001-no_adamtp-data_use=mix-flag"
    assert point_name([], groups) == ""
    assert point_name([("data.path", "/a b/c")], groups) == "path=_a_b_c"  # safe as a file name
    long = [(f"key{i}", "x" * 20) for i in range(6)]
    cut, other = point_name(long, groups), point_name(long[:5] + [("key5", "y" * 20)], groups)
    assert len(cut) == MAX_NAME and len(other) == MAX_NAME and cut != other  # cut, still unique


def test_swept_keys_come_from_the_command_line_and_the_sweeper_params(tmp_path):
    from mtp_train.cli.sweep import swept_keys

    assert swept_keys(tmp_path) is None  # no multirun.yaml: the caller falls back to every override
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "overrides": {"task": ["backbone=tiny", "loss=ce,kl", "train.lr=range(1,3)", "~foo"]},
        "sweeper": {"params": {"heads.k": "2,3,4", "seed": 1}}}}))
    assert swept_keys(tmp_path) == ["loss", "train.lr", "heads.k"]


def test_the_sweep_experiment_composes_as_documented(tmp_path):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR, compose_config

    cfg = compose_config(["experiment=smollm2_sweep", f"paths.output_dir={tmp_path}"])
    assert cfg.train.eval_after and cfg.eval.prompt_source == "unseen" and cfg.eval.n_prompts >= 20
    assert cfg.loss.topk == 0 and cfg.experiment_name == "smollm2_sweep"
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = compose("config", overrides=["experiment=smollm2_sweep"], return_hydra_config=True)
    assert dict(raw.hydra.sweeper.params) == {"heads.k": "2,3,4", "loss": "ce,kl,e2e_tv"}


def test_plot_orders_numbers_numerically_and_names_after():
    from mtp_train.sweep import _order

    pts = [("0.001", 1), ("1e-4", 2), ("abc", 3), ("2", 4)]
    assert [p[0] for p in sorted(pts, key=_order)] == ["1e-4", "0.001", "2", "abc"]


def test_table_lists_swept_values_only():
    rows = [{"point": "0", "overrides": {"a": "1", "b": "x"}, "status": "ok", "sim_tau": 1.5,
             "agree": [0.5], "acc": [0.4], "slurm_job_id": "7"},
            {"point": "1", "overrides": {"a": "2", "b": "x"}, "status": "missing"}]
    table = markdown_table(rows)
    assert "| point | a | status |" in table and "| b |" not in table
    assert "| 0 | 1 | ok | 1.5000 | 0.50 | 0.40 | 7 |" in table


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm started from the installed one (`make slurm`, which `make test` runs first).
    Not installed: a skip naming `make slurm`, a failure under CI=true (CI must run these tests)."""
    from tests.local_slurm import SlurmNotInstalled, SlurmUnavailable, require_installed, start

    try:
        require_installed()
    except SlurmNotInstalled as e:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI=true: {e}")
        pytest.skip(str(e))
    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as e:
        if os.geteuid() == 0:
            raise  # installed, and as root this starts it: a failure here is a bug
        pytest.skip(f"cannot start a local Slurm here: {e}")
    yield cluster
    pids = dict(cluster.pids)
    cluster.stop()
    for pid in pids.values():  # the daemons it started are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slurm
@pytest.mark.integration
def test_two_by_two_sweep_on_a_real_slurm(slurm, tmp_path):
    # the k=300 point fails on purpose: the summary, written when the last job ends, must say so
    r = _sweep(tmp_path, "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1",
               "hydra.launcher.mem_gb=null", "hydra.launcher.timeout_min=20",
               "heads.k=1,2,300", "loss=ce,kl", env=slurm.env, timeout=1500)
    assert r.returncode == 1 and "error: 2 sweep point(s) failed" in r.stderr, r.stderr[-3000:]
    assert "Slurm" in r.stdout + r.stderr or (tmp_path / "sweep" / ".submitit").is_dir()
    out = json.loads((tmp_path / "sweep" / "sweep_report.json").read_text())
    assert out["ok"] == 4 and out["failed"] == 2 and sorted(out["swept"]) == ["heads.k", "loss"]
    assert [Path(x["dir"]).name for x in out["points"]] == \
        ["0-k1-ce", "1-k1-kl", "2-k2-ce", "3-k2-kl", "4-k300-ce", "5-k300-kl"]
    assert all("failed: ConfigError: heads.k" in x["status"] + ": " + x.get("error", "")
               for x in out["points"][4:])
    rows = out["points"][:4]
    assert {(x["overrides"]["heads.k"], x["overrides"]["loss"]) for x in rows} == \
        {("1", "ce"), ("1", "kl"), ("2", "ce"), ("2", "kl")}
    jobs = {x["slurm_job_id"] for x in rows}
    assert None not in jobs and len(jobs) == 4  # each point ran as its own Slurm job
    for x in rows:
        assert (Path(x["dir"]) / "heads.safetensors").is_file()
        assert not math.isnan(x["sim_tau"]) and x["sim_tau"] >= 1.0
        assert len(x["agree"]) == int(x["overrides"]["heads.k"])
    assert Path(out["plot"]).is_file() and "failed: ConfigError" in (tmp_path / "sweep" / "sweep_report.md").read_text()
    assert slurm.wait_idle(), slurm.run("squeue", "-h").stdout  # every job ends


@pytest.mark.slurm
@pytest.mark.integration
def test_sbatch_template_runs_two_ranks_under_srun(slurm, tmp_path):
    """slurm/train_single_node.sbatch as a user submits it, with the GPU lines overridden for CPU:
    srun starts 2 tasks, Lightning takes its ranks from Slurm, rank 0 writes the heads."""
    repo = Path(__file__).parents[1]
    run = tmp_path / "run"
    prep_cli(*POINT, f"paths.root_dir={tmp_path}", cwd=tmp_path)  # as a user prepares before submitting
    env = {**slurm.env, "TRAINER": "ddp", "ACCELERATOR": "cpu", "MTP_REPO": str(repo),
           "MTP_VENV": str(Path(sys.executable).parents[1]), "RUN_DIR": str(run)}
    r = subprocess.run(["sbatch", "--wait", "--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1",
                        "--mem=2G", f"--output={tmp_path / 'job.out'}", "--export=ALL",
                        str(repo / "slurm" / "train_single_node.sbatch"), *POINT,
                        f"paths.root_dir={tmp_path}", "logger=csv"],
                       capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").is_file() else ""
    assert r.returncode == 0, r.stderr + log[-3000:]
    meta = json.loads((run / "heads.json").read_text())
    assert meta["run"]["world_size"] == 2 and meta["run"]["slurm_job_id"]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log


@pytest.mark.bad_input
@pytest.mark.integration
def test_an_output_directory_that_cannot_be_written_is_one_line_before_hydra_writes(tmp_path):
    """A run or sweep directory under a file, or where nothing can be created: exit 2 and one line
    naming the key, not Hydra's traceback from its mkdir."""
    from mtp_train.cli.sweep import unwritable_reason

    a_file = tmp_path / "afile"
    a_file.write_text("x")
    assert "Not a directory" in unwritable_reason(a_file / "run")
    assert unwritable_reason(tmp_path / "new" / "run") is None and (tmp_path / "new" / "run").is_dir()
    # a directory of 4,000 characters can be made, but the run's files below it pass PATH_MAX (an
    # OSError traceback mid-run, hostile round 3): refused up front
    deep, left = tmp_path, 4000 - len(str(tmp_path))
    while left > 1:
        part = "e" * min(200, left - 1)
        deep, left = deep / part, left - len(part) - 1
    assert len(str(deep)) >= 3990 and "too near the system's limit of 4096" in unwritable_reason(deep)
    assert not (tmp_path / ("e" * 200)).exists()  # hostile round 4: the refused path's folders were left behind
    def no_answer(path, name):
        raise OSError(22, "Invalid argument")

    with pytest.MonkeyPatch.context() as mp:  # a filesystem that does not say its limit: not checked
        mp.setattr(os, "pathconf", no_answer)
        assert unwritable_reason(deep) is None
    for args, key in ((["debug=smoke", f"hydra.run.dir={a_file}/run"], "hydra.run.dir"),
                      (["-m", "debug=smoke", "hydra.sweep.dir=/proc/mtp-no-such"], "hydra.sweep.dir")):
        r = subprocess.run([str(BIN / "mtp-train"), *args, f"paths.root_dir={tmp_path}"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.strip().startswith(f"error: {key}=") and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "cannot write there" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_command_refuses_another_commands_run_directory_before_hydra_writes_there(tmp_path):
    """mtp-eval with hydra.run.dir = mtp-train's run wrote its .hydra/ over the run's own (hostile
    round 3, P1): exit 2, one line naming the key and the owner, the run's record untouched."""
    from mtp_train.cli.sweep import other_commands_run, prepared_data

    run = tmp_path / "train"
    (run / ".hydra").mkdir(parents=True)
    (run / "heads.json").write_text("{}")
    (run / ".hydra" / "config.yaml").write_text("mine: true\n")
    assert other_commands_run(run, "train") is None
    assert other_commands_run(run, "eval") == ("mtp-train", "heads.json")
    (tmp_path / "clp").mkdir()
    (tmp_path / "clp" / "stage_times.json").write_text("{}")
    assert other_commands_run(tmp_path / "clp", "eval") == ("mtp-clp", "stage_times.json")
    assert other_commands_run(tmp_path / "clp", "clp") is None
    # hostile round 4: mtp-eval could write into the prepared data
    (tmp_path / "data" / "labelled").mkdir(parents=True)
    assert prepared_data(tmp_path / "data") is None
    (tmp_path / "data" / "labelled" / "manifest.json").write_text("{}")
    assert prepared_data(tmp_path / "data") == "labelled/manifest.json"
    assert prepared_data(tmp_path / "data" / "labelled") == "manifest.json"
    assert prepared_data(run) is None
    r = subprocess.run([str(BIN / "mtp-eval"), "debug=smoke", f"eval.train_run={run}", f"hydra.run.dir={run}",
                        f"paths.root_dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == (f"error: hydra.run.dir={run}: this is mtp-train's run directory (heads.json is there); "
                                "mtp-eval writes its own: choose another hydra.run.dir"), r.stderr[-2000:]
    assert (run / ".hydra" / "config.yaml").read_text() == "mine: true\n"
    r = subprocess.run([str(BIN / "mtp-eval"), "debug=smoke", f"eval.train_run={run}",
                        f"hydra.run.dir={tmp_path / 'data'}", f"paths.root_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: hydra.run.dir={tmp_path / 'data'}: this holds mtp-prep's prepared data (labelled/manifest.json is "
        "there); mtp-eval writes its run elsewhere: choose another hydra.run.dir"), r.stderr[-2000:]
    assert not (tmp_path / "data" / ".hydra").exists()
