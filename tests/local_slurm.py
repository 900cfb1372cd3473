"""A real one-node Slurm on this machine (munge + slurmctld + slurmd), to try SLURM sweeps locally
and to test them: the same sbatch / submitit path a cluster takes, not a mock.

  python -m tests.local_slurm start --dir /tmp/slurm   # prints `export SLURM_CONF=...`
  python -m tests.local_slurm stop --dir /tmp/slurm

It starts an installed Slurm (Debian's `slurm-wlm` and `munge`: `make slurm` installs them, as
root) and installs nothing itself; `start` raises SlurmUnavailable naming `make slurm` when they are
missing. Everything the daemons write (state, spool, logs, pid files) stays under the given
directory; `stop` kills exactly the daemons `start` started, by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
PROGRAMS = (*DAEMONS, "sbatch")  # what `make slurm` checks for, and installs when missing


class SlurmUnavailable(RuntimeError):
    pass


def _which(name: str) -> str | None:
    """`name` on PATH, or in /usr/sbin (where Debian puts the daemons, often off a user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin")


class SlurmNotInstalled(SlurmUnavailable):
    pass


def missing_programs() -> list[str]:
    """The Slurm and munge programs this machine lacks (empty when Slurm is installed)."""
    return [p for p in PROGRAMS if not _which(p)]


def require_installed() -> None:
    """Raise SlurmNotInstalled, naming the missing programs and `make slurm`, unless installed."""
    if missing := missing_programs():
        raise SlurmNotInstalled(f"Slurm is not installed ({', '.join(missing)} not found); "
                                "`make slurm` installs it (root, apt-get)")


def _munge_works() -> bool:
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        return enc.returncode == 0 and subprocess.run(
            ["unmunge"], input=enc.stdout, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


SLURM_CONF = """\
ClusterName=mtplocal
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalSlurm:
    """A running one-node cluster; `env` is what sbatch/srun/squeue need (SLURM_CONF)."""

    dir: Path
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)

    def wait_idle(self, timeout: float = 60) -> bool:
        """Wait until no job is queued or running (a job's result can be read before Slurm
        has marked the job complete); True when the queue emptied in time."""
        end = time.time() + timeout
        while time.time() < end:
            r = self.run("squeue", "-h")
            if r.returncode == 0 and not r.stdout.strip():
                return True
            time.sleep(1)
        return False

    def stop(self) -> None:
        """Kill the daemons this instance started (slurmd first, munged last), by pid."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None or not _is(pid, name):  # gone, or the pid now belongs to another program
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it exited just now
        (self.dir / "pids.json").unlink(missing_ok=True)


def _is(pid: int, name: str) -> bool:
    """Whether process `pid` runs the program `name` (a stale pid file must not kill anything else)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().startswith(name[:15])
    except OSError:
        return False


def _read_pid(path: Path, timeout: float = 20) -> int:
    end = time.time() + timeout
    while time.time() < end:
        if path.is_file() and path.read_text().strip():
            return int(path.read_text().split()[0])
        time.sleep(0.2)
    raise SlurmUnavailable(f"{path}: daemon wrote no pid file; see the logs next to it")


def start(directory: str | Path, cpus: int | None = None, timeout: float = 60) -> LocalSlurm:
    """Start munged (unless a working one is running), slurmctld and slurmd with a one-node config
    under `directory`; returns when the node is idle and accepts jobs."""
    require_installed()
    d = Path(directory).resolve()
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    ports = [_free_port()]
    while len(ports) < 2:
        if (p := _free_port()) != ports[0]:
            ports.append(p)
    d.joinpath("slurm.conf").write_text(SLURM_CONF.format(
        host=host, dir=d, cpus=cpus or os.cpu_count() or 1, mem=max(256, _mem_mb() - 512),
        ctld_port=ports[0], d_port=ports[1]))
    cluster = LocalSlurm(d)
    try:
        if not _munge_works():
            run_dir = Path("/run/munge")
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.chown(run_dir, "munge", "munge")
            key = Path("/etc/munge/munge.key")
            if not key.is_file():
                subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
                shutil.chown(key, "munge", "munge")
            pid_file = run_dir / "munged.pid"
            pid_file.unlink(missing_ok=True)
            subprocess.run(["runuser", "-u", "munge", "--", _which("munged"), "--force"],
                           check=True, capture_output=True, timeout=30)
            cluster.pids["munged"] = _read_pid(pid_file)
            if not _munge_works():
                raise SlurmUnavailable("munged started but munge -n | unmunge fails")
        for daemon in ("slurmctld", "slurmd"):
            (d / f"{daemon}.pid").unlink(missing_ok=True)  # never read a killed instance's pid
            r = subprocess.run([_which(daemon), "-f", str(cluster.conf)], env=cluster.env,
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise SlurmUnavailable(f"{daemon} failed to start: {r.stderr[-500:]}")
            cluster.pids[daemon] = _read_pid(d / f"{daemon}.pid")
        (d / "pids.json").write_text(json.dumps(cluster.pids))
        end = time.time() + timeout
        while time.time() < end:
            r = cluster.run("sinfo", "-h", "-o", "%t")
            if r.returncode == 0 and r.stdout.strip() in ("idle", "mix", "alloc"):
                return cluster
            time.sleep(1)
        raise SlurmUnavailable(f"the node never became idle (sinfo: {r.stdout.strip() or r.stderr.strip()}); "
                               f"see {d}/slurmctld.log and {d}/slurmd.log")
    except BaseException:
        cluster.stop()
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.local_slurm", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--dir", default="/tmp/mtp-slurm", help="config, state, logs and pid files")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    if args.action == "start":
        cluster = start(d)
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        pids = json.loads((d / "pids.json").read_text()) if (d / "pids.json").is_file() else {}
        LocalSlurm(d.resolve(), pids).stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
