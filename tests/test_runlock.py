"""One command per run directory: refused with the holder's pid, free again after kill -9, and the
holder's Hydra config restored after a refused command wrote over it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtp_train.errors import MtpError
from mtp_train.layout import LOCK_HOLDER as HOLDER
from mtp_train.runlock import run_lock

BIN = Path(sys.executable).parent
HOLD = "import sys, time; from mtp_train.runlock import run_lock\nwith run_lock(sys.argv[1], 'holder'):\n" \
       "    print('held', flush=True); time.sleep(600)"


def _hold(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.bad_input
def test_a_second_command_is_refused_naming_the_holder(tmp_path):
    with run_lock(tmp_path, "mtp-train"):
        assert (tmp_path / HOLDER).is_file()
        with pytest.raises(MtpError, match=rf"{tmp_path}: run directory in use by pid {os.getpid()} "
                                           r"\(mtp-train on .*, since .*\); wait for it"):
            with run_lock(tmp_path, "mtp-eval"):
                pass
    assert not (tmp_path / HOLDER).exists()
    with run_lock(tmp_path, "mtp-eval"):  # released: the next one goes ahead
        pass


@pytest.mark.bad_input
@pytest.mark.integration
def test_the_lock_is_free_again_after_its_holder_is_killed_with_sigkill(tmp_path):
    p = _hold(tmp_path)
    try:
        with pytest.raises(MtpError, match=rf"in use by pid {p.pid} \(holder"):
            with run_lock(tmp_path, "mtp-train"):
                pass
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (tmp_path / HOLDER).is_file()  # the dead holder's note stays; the OS dropped its lock
    with run_lock(tmp_path, "mtp-train"):
        pass


@pytest.mark.bad_input
def test_the_holders_hydra_config_is_put_back_after_another_command_wrote_over_it(tmp_path, caplog):
    cfg = tmp_path / ".hydra" / "config.yaml"
    cfg.parent.mkdir()
    cfg.write_text("heads:\n  k: 3\n")
    with caplog.at_level("WARNING"), run_lock(tmp_path, "mtp-train"):
        cfg.write_text("heads:\n  k: 2\n")  # what Hydra does for a second command before it is refused
    assert cfg.read_text() == "heads:\n  k: 3\n" and "restored" in caplog.text


@pytest.mark.bad_input
@pytest.mark.integration
def test_mtp_train_on_a_run_directory_in_use_exits_with_one_line_and_touches_nothing(tmp_path):
    """The issue's case: a second mtp-train (another k) on the directory of a running one."""
    run = tmp_path / "run"
    p = _hold(run)
    try:
        t0 = time.time()
        r = subprocess.run([str(BIN / "mtp-train"), "backbone=tiny", "heads.k=2", f"hydra.run.dir={run}",
                            f"paths.root_dir={tmp_path}", "logger=none"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"run directory in use by pid {p.pid}" in r.stderr and "Traceback" not in r.stderr
        assert not (run / "checkpoints").exists() and not (run / "superseded").exists()
        assert time.time() - t0 < 120
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
