"""One command at a time per run directory.

`mtp-train`, `mtp-clp`, `mtp-eval` and `mtp-export-heads` write into a run directory; two of them in
one directory interleave their checkpoints, metadata and logs. Each takes `run_lock` first: an OS file
lock (`flock`), which the kernel drops when its holder exits in any way, `kill -9` included, so a
stale lock never needs clearing by hand. A second command is refused at once, naming the holder.

Hydra writes `.hydra/*.yaml` of a refused command before the command runs, over the holder's; the
holder puts its own back when it finishes (export reads the recipe from there).
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mtp_train.artifacts import read_json, write_json_atomic
from mtp_train.errors import MtpError
from mtp_train.layout import HYDRA_DIR, LOCK_HOLDER, RUN_LOCK

log = logging.getLogger(__name__)


def is_rank_zero() -> bool:
    """Before Lightning sets ranks up: rank 0 of a torchrun/srun launch, or a single process."""
    return all(os.environ.get(v, "0") == "0"
               for v in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))


@contextmanager
def run_lock(run_dir: Path, command: str) -> Iterator[None]:
    """Hold `run_dir` for `command` (rank 0 only: the other ranks of a run share its directory)."""
    if not is_rank_zero():
        yield
        return
    import fcntl

    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise MtpError(f"{run_dir}: cannot write the run directory's lock file ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        h = read_json(run_dir / LOCK_HOLDER) or {}
        raise MtpError(f"{run_dir}: run directory in use by pid {h.get('pid', '?')} ({h.get('command', '?')} "
                       f"on {h.get('host', '?')}, since {h.get('since', '?')}); wait for it to finish or "
                       "choose another directory (hydra.run.dir=...)") from None
    except OSError as e:  # a file system without flock (some NFS / Lustre mounts)
        os.close(fd)
        raise MtpError(f"{run_dir}: this file system cannot lock files ({e.strerror}); put run directories "
                       "on one that can (paths.output_dir / hydra.run.dir)") from None
    recipe: dict[Path, bytes] = {}
    try:
        write_json_atomic(run_dir / LOCK_HOLDER, {"pid": os.getpid(), "command": command, "host": platform.node(),
                                             "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        recipe.update({p: p.read_bytes() for p in sorted((run_dir / HYDRA_DIR).glob("*.yaml"))})
        yield
    finally:
        for path, blob in recipe.items():
            if not path.is_file() or path.read_bytes() != blob:
                path.write_bytes(blob)
                log.warning("%s: another command started here while %s ran and wrote its config over "
                            "this run's; restored", path, command)
        (run_dir / LOCK_HOLDER).unlink(missing_ok=True)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
