"""Who a run is, for W&B and on disk: its name, its sweep group, its tags and its job type.

A single run keeps the experiment's name (`logger.wandb.name`). A point of a multirun (`-m`, local
or through the Slurm launcher) is named after the values its sweep varies, in command-line order
(`heads.k=3 loss=kl` -> `k3-kl`), and the same name ends its run directory (`<sweep>/4-k3-kl`) and
its CSV logger's directory (`csv/k3-kl`), so a reader can match W&B and disk. Every point of one
multirun shares the group `<experiment>-<sweep directory name>` (the start time by default) and is
tagged with its swept overrides (`heads.k=3`, `loss=kl`) and, on Slurm, the array job's id.
The sweep summary (mtp_train/sweep.py) logs to the same group.

Which point this process runs is said by the entry point (mtp_train/cli/sweep.py reads it from
Hydra's config and calls `set_sweep_point`), so nothing here needs Hydra.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

MAX_NAME = 64  # W&B shows names up to this length; tags are limited to 64 characters
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


@dataclass
class RunIdentity:
    job_type: str
    name: str | None = None  # None: the logger config's own name (a single run)
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    def wandb_kwargs(self) -> dict:
        return {"job_type": self.job_type,
                **({"name": self.name} if self.name else {}),
                **({"group": self.group, "tags": self.tags} if self.group else {})}


def _part(key: str, value: str, groups: set[str]) -> str:
    if key in groups:  # a config group: its option says it all (loss=kl -> kl)
        return value.rsplit("/", 1)[-1]
    short = key.rsplit(".", 1)[-1]
    if value.lower() in ("true", "false"):
        return short if value.lower() == "true" else f"no_{short}"
    try:
        float(value)
        return f"{short}{value}"  # heads.k=3 -> k3, train.lr=0.001 -> lr0.001
    except ValueError:
        return f"{short}={value}"


def point_name(values: list[tuple[str, str]], groups: set[str]) -> str:
    """A short, file-name-safe name from a point's swept values; "" when nothing is swept."""
    name = _UNSAFE.sub("_", "-".join(_part(k, v, groups) for k, v in values))
    if len(name) > MAX_NAME:  # still unique: the cut is followed by a hash of the whole
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[:MAX_NAME - 9]}~{digest}"
    return name


def sweep_group(experiment_name: str, sweep_dir: str | Path) -> str:
    return f"{experiment_name}-{Path(sweep_dir).name}"


@dataclass(frozen=True)
class SweepPoint:
    """One point of a multirun: its name, the values its sweep varies, and the sweep's directory."""
    name: str
    values: list[tuple[str, str]]
    sweep_dir: str


_point: SweepPoint | None = None  # None: a single run


def set_sweep_point(point: SweepPoint | None) -> None:
    """Say which multirun point this process runs (None: a single run); the entry point does."""
    global _point
    _point = point


def sweep_point() -> SweepPoint | None:
    return _point


def identity(experiment_name: str, job_type: str) -> RunIdentity:
    """This process's run: a multirun point is named, grouped and tagged; a single run is not."""
    point = _point
    if point is None:
        return RunIdentity(job_type=job_type)
    tags = [f"{k}={v}"[:MAX_NAME] for k, v in point.values]
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        tags.append(f"slurm_array={os.environ['SLURM_ARRAY_JOB_ID']}")
    return RunIdentity(job_type=job_type, name=point.name or experiment_name,
                       group=sweep_group(experiment_name, point.sweep_dir), tags=tags)


def offline_without_key() -> bool:
    """Without WANDB_API_KEY, W&B runs offline (<dir>/wandb/offline-run-*, `wandb sync` later): never a
    login prompt on these machines. True when offline."""
    if key := os.environ.get("WANDB_API_KEY"):
        if len(key.strip()) < 40:  # W&B's own rule; caught here before a login attempt and its traceback
            from mtp_train.errors import ConfigError

            raise ConfigError(f"WANDB_API_KEY: has {len(key.strip())} characters, and W&B keys have 40 or more; "
                              "fix it, or unset it to log offline (`wandb sync` later)")
        if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
            return True
        if (why := server_out_of_reach()) is None:
            return False
        import logging

        logging.getLogger(__name__).warning(
            "W&B: %s; logging offline instead (the run's wandb/offline-run-* folder; `wandb sync` it later)", why)
    os.environ["WANDB_MODE"] = "offline"
    return True


REACH_TIMEOUT_S = 5.0  # W&B's own init waits 90 s and then raises; a compute node without internet is common


def server_out_of_reach(timeout: float = REACH_TIMEOUT_S) -> str | None:
    """Why W&B's server (WANDB_BASE_URL, else api.wandb.ai) cannot be reached from here, or None when a
    TCP connection to it opens within `timeout` seconds."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    base = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    url = urlsplit(base if "://" in base else f"https://{base}")
    try:
        port = url.port or (80 if url.scheme.lower() == "http" else 443)
        problem = None if url.hostname else "no host"
    except ValueError as err:  # a port that is not a number, or out of range
        problem = str(err)
    if problem:
        from mtp_train.errors import ConfigError

        raise ConfigError(f"WANDB_BASE_URL={base!r}: not a server address ({problem}); fix it, or unset it "
                          "for W&B's own server")
    host = url.hostname
    proxies = urllib.request.getproxies()
    if (proxies.get(url.scheme.lower()) or proxies.get("all")) and not urllib.request.proxy_bypass(host):
        return None  # through a proxy: only W&B itself can tell
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host}:{port} cannot be reached from this machine ({err.strerror or type(err).__name__})"
    return None


def wandb_init(cfg, job_type: str, directory: str | Path, **kwargs):
    """A W&B run for a stage other than training (clp, eval, the sweep summary): the project of
    `logger.wandb`, this process's identity, offline without an API key. None without logger=wandb."""
    if not cfg.logger or "wandb" not in cfg.logger:
        return None
    import wandb

    offline_without_key()
    lcfg = cfg.logger["wandb"]
    ident = identity(cfg.experiment_name, job_type)
    args = {"name": f"{lcfg.get('name') or cfg.experiment_name}-{job_type}", **ident.wandb_kwargs(), **kwargs}
    Path(directory).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=lcfg.get("project"), dir=str(directory), **args)
