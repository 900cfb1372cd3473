"""What a Hydra multirun (`-m`, local or through the Slurm launcher) asks of mtp-train.

Each point's name comes from the values its sweep varies (mtp_train/tracking.py names them): the
resolver `${mtp_point_dir:...}` puts it in the point's run directory (conf/config.yaml), and
`current_point` hands it to the library as a plain `SweepPoint` before the task runs. Which keys a
sweep varies is read from the sweep's `multirun.yaml`, which Hydra writes into the sweep directory
before the first point starts (command-line sweeps and `hydra.sweeper.params`). `SweepSummary` is
the callback that writes the sweep summary (mtp_train/sweep.py) when a multirun of mtp-train ends.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback

from mtp_train import layout
from mtp_train.layout import FAILED
from mtp_train.tracking import SweepPoint, point_name

MULTIRUN_CONFIG = "multirun.yaml"


def _parse(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides=list(overrides))


def swept_keys(sweep_dir: str | Path) -> list[str] | None:
    """The keys the multirun in `sweep_dir` varies, in the order it names them; None when the sweep
    wrote no multirun.yaml (then every point override counts)."""
    path = Path(sweep_dir) / MULTIRUN_CONFIG
    if not path.is_file():
        return None
    return _swept_in((yaml.safe_load(path.read_text()) or {}).get("hydra") or {})


def _swept_in(hydra: dict) -> list[str]:
    """The keys a multirun varies, from its Hydra config (the `hydra` node, as a plain dict)."""
    keys = [o.key_or_group for o in _parse((hydra.get("overrides") or {}).get("task") or [])
            if o.is_sweep_override()]
    params = (hydra.get("sweeper") or {}).get("params") or {}
    for key, value in params.items():  # hydra.sweeper.params: {heads.k: "2,3,4", ...}
        override = _parse([f"{key}={value}"])[0]
        if override.is_sweep_override():
            keys.append(override.key_or_group)
    return list(dict.fromkeys(keys))


def point_values(overrides: list[str], keys: list[str]) -> list[tuple[str, str]]:
    """(key, value) of `keys` among one point's overrides, in the order of `keys`."""
    found = {}
    for o in _parse(overrides):
        if not o.is_delete() and not o.is_sweep_override():
            found[o.key_or_group] = o.get_value_element_as_str()
    return [(k, found[k]) for k in keys if k in found]


_PER_JOB = ("hydra.job.num", "hydra.job.id", "hydra.job.override_dirname")  # distinct for every point


def subdir_unnamed(subdir: str, swept: list[str]) -> list[str]:
    """The swept keys that `hydra.sweep.subdir` (unresolved) does not tell apart: empty when it names a
    per-job value, or every swept key (`${heads.k}`, a group by `${hydra.runtime.choices.loss}` or a
    key under it). Two points that differ only in an unnamed key would share one directory."""
    refs = set(re.findall(r"\$\{([^${}:]+)\}", subdir))  # innermost plain references, not resolver calls
    if refs & set(_PER_JOB):
        return []

    def named(key: str) -> bool:
        return any(r == key or r.startswith(key + ".") or r == f"hydra.runtime.choices.{key}" for r in refs)

    return [k for k in swept if not named(k)]


def _hydra_point(hc) -> tuple[str, list[tuple[str, str]]]:
    """(name, swept values) of the current multirun point, from Hydra's config `hc` (its `hydra` node)."""
    overrides = list(hc.overrides.task)
    keys = swept_keys(hc.sweep.dir)
    if keys is None:
        keys = [o.key_or_group for o in _parse(overrides) if not o.is_delete()]
    values = point_values(overrides, keys)
    return point_name(values, set(hc.runtime.choices or {})), values


def point_dir_name(num, _root_) -> str:
    """Resolver behind `hydra.sweep.subdir`: `<job number>-<point name>` (the number keeps the
    launch order and tells apart two points whose names are cut to the same prefix)."""
    name, _ = _hydra_point(_root_.hydra)
    return f"{num}-{name}" if name else str(num)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mtp_point_dir"):
        OmegaConf.register_new_resolver("mtp_point_dir", point_dir_name)


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def current_point() -> SweepPoint | None:
    """The multirun point this process runs, from Hydra's config; None for a single run."""
    if not in_multirun():
        return None
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    name, values = _hydra_point(hc)
    return SweepPoint(name=name, values=values, sweep_dir=str(hc.sweep.dir))


def unwritable_reason(directory: Path) -> str | None:
    """Why `directory` cannot be created and written (None: it can; it is then created, as Hydra
    would create it next): what the filesystem says to a mkdir and to a probe file inside, or a path
    too near the system's limit. A refused directory leaves none of the folders the probe made."""
    import os
    import tempfile

    d = Path(directory)
    made = [p for p in (d, *d.absolute().parents) if not p.exists()]  # deepest first
    why = None
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        why = f"{e.filename or d}: {e.strerror}"
    if why is None:
        # the run's files go up to two folders and ~80 characters below it (checkpoints, csv/version_0,
        # temporary names): a directory this close to the system's path limit fails there, mid-run
        try:
            limit = os.pathconf(d, "PC_PATH_MAX")
        except (OSError, ValueError):  # a filesystem that does not say: no check
            limit = -1
        if limit > 0 and len(str(d.resolve())) + RUN_FILES_DEPTH > limit:
            why = (f"its path is {len(str(d.resolve()))} characters long, too near the system's limit of {limit} "
                   "for the files a run writes below it")
    if why is not None:
        for p in made:
            try:
                p.rmdir()
            except OSError:  # not made here after all, or not empty: left as it is
                break
    return why


RUN_FILES_DEPTH = 160  # characters the deepest file of a run adds below its directory, with margin


# what each Hydra command leaves in its own run directory (by its job name: the entry point's file)
_STAGE_MARKERS = {"train": (layout.HEADS_META, layout.CHECKPOINTS), "eval": (layout.EVAL_REPORT,),
                  "clp": (layout.STAGE_TIMES, layout.LABELS)}
_COMMANDS = {"train": "mtp-train", "eval": "mtp-eval", "clp": "mtp-clp", "prep": "mtp-prep"}


def prepared_data(directory: Path) -> str | None:
    """The file that marks `directory` as mtp-prep's data (a prepared dataset, a hidden-state cache or
    the data directory holding them), None when it is not: no command's run directory belongs there."""
    for name in (layout.MANIFEST, f"{layout.LABELLED}/{layout.MANIFEST}", f"{layout.DISTILLED}/{layout.MANIFEST}"):
        if (directory / name).is_file():
            return name
    return None


def other_commands_run(directory: Path, job: str) -> tuple[str, str] | None:
    """(command, file) when `directory` is the run directory of another command than `job`: Hydra
    would write this command's .hydra/ record over that run's own."""
    for owner, names in _STAGE_MARKERS.items():
        if owner != job and (found := next((n for n in names if (directory / n).exists()), None)):
            return _COMMANDS[owner], found
    return None


class OutputDirCheck(Callback):
    """Hydra callback: before a run (or a multirun) writes its .hydra/ record, refuse in one line an
    output directory that cannot be written, instead of Hydra's traceback from its mkdir, and one that
    is another command's run directory (mtp-eval into mtp-train's run overwrote that run's .hydra/)."""

    @staticmethod
    def _check(key: str, directory) -> None:
        import sys

        if (why := unwritable_reason(Path(str(directory)))) is not None:
            print(f"error: {key}={directory}: cannot write there ({why}); choose another "
                  f"{key} or paths.root_dir", file=sys.stderr)
            raise SystemExit(2)

    def on_run_start(self, config, **kwargs) -> None:
        import sys

        self._check("hydra.run.dir", config.hydra.run.dir)
        job = str(config.hydra.job.name)
        if job in _COMMANDS and (found := prepared_data(Path(str(config.hydra.run.dir)))):
            print(f"error: hydra.run.dir={config.hydra.run.dir}: this holds mtp-prep's prepared data ({found} is "
                  f"there); {_COMMANDS[job]} writes its run elsewhere: choose another hydra.run.dir", file=sys.stderr)
            raise SystemExit(2)
        if job in _COMMANDS and (found := other_commands_run(Path(str(config.hydra.run.dir)), job)):
            print(f"error: hydra.run.dir={config.hydra.run.dir}: this is {found[0]}'s run directory ({found[1]} is "
                  f"there); {_COMMANDS[job]} writes its own: choose another hydra.run.dir", file=sys.stderr)
            raise SystemExit(2)

    def on_multirun_start(self, config, **kwargs) -> None:
        import sys

        from omegaconf import OmegaConf

        self._check("hydra.sweep.dir", config.hydra.sweep.dir)
        hydra = OmegaConf.to_container(config.hydra, resolve=False)
        subdir = str(hydra["sweep"].get("subdir"))
        if (unnamed := subdir_unnamed(subdir, _swept_in(hydra))):
            # points differing only in these keys would train into one directory, each superseding the last
            print(f"error: hydra.sweep.subdir={subdir}: the sweep's points would share one directory (it does "
                  f"not name {', '.join(unnamed)}); name each point: ${{hydra.job.num}}, as the default "
                  "${mtp_point_dir:${hydra.job.num}} does, or every swept key", file=sys.stderr)
            raise SystemExit(2)


MULTIRUN_STARTED = ".multirun_started"  # in the sweep directory: when the last multirun into it began
FAILED_POINTS: list[Path] = []  # the FAILED.txt of the multirun this process just ran (its exit code)


class SweepSummary(Callback):
    """Hydra callback: after a multirun (local, or once every Slurm job has ended), the points that
    failed (`FAILED_POINTS`: the command then exits 1); after an mtp-train multirun also the sweep
    summary beside the points and, with logger=wandb, in the sweep's W&B group."""

    def on_multirun_start(self, config, **kwargs) -> None:
        import time

        # the start as the sweep directory's filesystem dates it: the points' files are dated by the same
        # clock (a file server's, under Slurm on NFS), which may differ from this machine's
        self._started = time.time()
        marker = Path(str(config.hydra.sweep.dir)) / MULTIRUN_STARTED
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{self._started}\n")
            self._started = marker.stat().st_mtime
        except OSError:
            pass

    def on_multirun_end(self, config, **kwargs) -> None:
        # only this multirun's failures (a reused sweep directory may hold older points' FAILED.txt)
        since = getattr(self, "_started", 1.0) - 1.0  # file times come from a coarse clock
        FAILED_POINTS[:] = sorted(f for f in Path(str(config.hydra.sweep.dir)).glob(f"*/{FAILED}")
                                  if f.stat().st_mtime >= since)
        if config.hydra.job.name != "train":  # only mtp-train's points hold heads.json
            return
        from mtp_train.sweep import summarize

        summarize(config, str(config.hydra.sweep.dir), since=since)
