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

from mtp_train.sweep import gather, markdown_table, report
from tests.helpers import prep_cli

BIN = Path(sys.executable).parent
POINT = ["backbone=tiny", "logger=none", "trainer.max_steps=4", "trainer.val_check_interval=2",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def _sweep(tmp_path, *overrides, env=None, timeout=900):
    prep_cli(*POINT, f"paths.root_dir={tmp_path}", cwd=tmp_path)
    return subprocess.run([str(BIN / "mtp-train"), "-m", *POINT, f"paths.root_dir={tmp_path}",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


@pytest.mark.bad_input
def test_a_failing_point_does_not_stop_the_sweep_and_the_report_shows_it(tmp_path):
    r = _sweep(tmp_path, "heads.k=300,2", "loss=ce")  # the first point fails (k longer than the rows)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = gather(tmp_path / "sweep")
    assert [x["status"] for x in rows] == ["failed", "ok"]
    assert "heads.k" in rows[0]["error"] and rows[0]["overrides"]["heads.k"] == "300"
    assert rows[1]["sim_tau"] >= 1.0 and (tmp_path / "sweep" / "1" / "heads.safetensors").is_file()
    out = report(tmp_path / "sweep")
    assert out["failed"] == 1 and out["ok"] == 1 and out["swept"] == ["heads.k"]
    assert Path(out["plot"]).stat().st_size > 1000
    table = (tmp_path / "sweep" / "sweep_report.md").read_text()
    assert "failed: ConfigError: heads.k" in table
    r = subprocess.run([sys.executable, "bench/sweep_report.py", str(tmp_path / "sweep")],
                       capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert r.returncode == 1 and "1 ok, 1 failed" in r.stdout


@pytest.mark.bad_input
def test_report_refuses_a_directory_without_points(tmp_path):
    from mtp_train.errors import MtpError

    with pytest.raises(MtpError, match="no sweep points"):
        gather(tmp_path)


def test_plot_orders_numbers_numerically_and_names_after():
    from mtp_train.sweep import _order

    pts = [("0.001", 1), ("1e-4", 2), ("abc", 3), ("2", 4)]
    assert [p[0] for p in sorted(pts, key=_order)] == ["1e-4", "0.001", "2", "abc"]


def test_table_lists_swept_values_only():
    rows = [{"point": "0", "overrides": {"a": "1", "b": "x"}, "status": "ok", "sim_tau": 1.5,
             "agree": [0.5], "slurm_job_id": "7"},
            {"point": "1", "overrides": {"a": "2", "b": "x"}, "status": "missing"}]
    table = markdown_table(rows)
    assert "| point | a | status |" in table and "| b |" not in table
    assert "| 0 | 1 | ok | 1.5000 | 0.50 | 7 |" in table


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from tests.local_slurm import SlurmUnavailable, start

    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as e:
        if os.geteuid() == 0:
            raise  # as root on Debian the project installs and starts Slurm itself: this must work
        pytest.skip(f"cannot start a local Slurm here: {e}")
    yield cluster
    pids = dict(cluster.pids)
    cluster.stop()
    for pid in pids.values():  # the daemons it started are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slurm
def test_two_by_two_sweep_on_a_real_slurm(slurm, tmp_path):
    r = _sweep(tmp_path, "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1",
               "hydra.launcher.mem_gb=null", "hydra.launcher.timeout_min=20",
               "heads.k=1,2", "loss=ce,kl", env=slurm.env, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Slurm" in r.stdout + r.stderr or (tmp_path / "sweep" / ".submitit").is_dir()
    out = report(tmp_path / "sweep")
    rows = out["points"]
    assert out["ok"] == 4 and sorted(out["swept"]) == ["heads.k", "loss"]
    assert {(x["overrides"]["heads.k"], x["overrides"]["loss"]) for x in rows} == \
        {("1", "ce"), ("1", "kl"), ("2", "ce"), ("2", "kl")}
    jobs = {x["slurm_job_id"] for x in rows}
    assert None not in jobs and len(jobs) == 4  # each point ran as its own Slurm job
    for x in rows:
        assert (Path(x["dir"]) / "heads.safetensors").is_file()
        assert not math.isnan(x["sim_tau"]) and x["sim_tau"] >= 1.0
        assert len(x["agree"]) == int(x["overrides"]["heads.k"])
    assert json.loads((tmp_path / "sweep" / "sweep_report.json").read_text())["ok"] == 4
    assert Path(out["plot"]).is_file()
    assert slurm.wait_idle(), slurm.run("squeue", "-h").stdout  # every job ends


@pytest.mark.slurm
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
