"""What every Hydra entry point shares: the conf/ directory and its schema, the process's
environment, composing outside a Hydra app, and the wrapper that validates the config and turns
errors into one clean line."""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from mtp_train.cli.sweep import current_point, in_multirun, register_resolvers
from mtp_train.config import Config
from mtp_train.config_rules import READS, validate
from mtp_train.errors import MtpError
from mtp_train.layout import FAILED
from mtp_train.tracking import set_sweep_point

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
log = logging.getLogger("mtp_train")


def register_configs() -> None:
    """conf/config.yaml's defaults list starts from this schema (Hydra's ConfigStore)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=Config)


register_configs()
register_resolvers()  # ${mtp_point_dir:...}, a sweep point's directory name (conf/config.yaml)


def offline_environment() -> None:
    """Never let the hub block a run on a network call on these machines (HF_HUB_OFFLINE=1), and
    keep the tokenizers library single-threaded (TOKENIZERS_PARALLELISM=false), unless the caller
    set them. Call it first: the hub reads the variable once, when it is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# out of space, file too large, no permission, read-only file system, not a directory
_WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EDQUOT}


def compose_config(overrides: list[str]) -> Config:
    """conf/config.yaml with `overrides`, validated, outside a Hydra app (benchmarks, scripts); sets
    the same environment as the entry points."""
    from hydra import compose, initialize_config_dir

    offline_environment()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return validate(compose("config", overrides=overrides))


# how libraries that wrap the OS error report a failed write (safetensors' SafetensorError, pyarrow's
# ArrowIOError without an errno): their messages carry the OS's own words
_WRITE_WORDS = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Permission denied",
                "File too large")

# how torch.save's zip writer words a write that fell short
_TORCH_SAVE_WORDS = ("PytorchStreamWriter failed writing", "unexpected pos")


def write_failure(error: BaseException) -> str | None:
    """'<file>: <reason>' when `error` is a write the filesystem refused (a full disk, read-only,
    permissions), however the library that wrote reports it; None otherwise."""
    if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:
        return f"{error.filename or 'a file'}: {error.strerror}"
    text = str(error)
    for words in _WRITE_WORDS:
        if words in text:
            return f"{type(error).__name__}: {words} ({text.splitlines()[0][:200] if text else ''})"
    if isinstance(error, RuntimeError) and any(w in text for w in _TORCH_SAVE_WORDS):
        # torch.save's zip writer reports a short write (a full disk) without the OS's reason
        return f"torch.save could not write a checkpoint, the disk is probably full ({text.strip().splitlines()[0][:160]})"
    return None


def wandb_failure(error: BaseException) -> str:
    """One line for an error W&B raised (an invalid key, a server out of reach after its timeout)."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return (f"{type(error).__name__}: {first}; what was saved is kept. Log offline with "
            "WANDB_MODE=offline (or unset WANDB_API_KEY) and `wandb sync` the run later")


def run_app(app) -> None:
    """Run a Hydra entry point; after a multirun whose points did not all succeed, name them and exit 1
    (the other points ran: a failed one does not stop the sweep, but the command does not pass)."""
    from mtp_train.cli.sweep import FAILED_POINTS

    FAILED_POINTS.clear()
    app()
    if FAILED_POINTS:
        print(f"error: {len(FAILED_POINTS)} sweep point(s) failed (the reason is in each FAILED.txt): "
              + ", ".join(str(f.parent) for f in FAILED_POINTS), file=sys.stderr)
        raise SystemExit(1)


def _failure_file() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir, FAILED)


def _record_failure(error: BaseException) -> float:
    """A failed sweep point: say why in <run dir>/FAILED.txt (the sweep report shows it) and return
    NaN so the launcher goes on with the other points instead of stopping the sweep."""
    import traceback

    from hydra.core.hydra_config import HydraConfig

    path = _failure_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"{type(error).__name__}: {error}\n\n" + "".join(
        traceback.format_exception(type(error), error, error.__traceback__))
    path.write_text(text)
    log.error("sweep point %s failed: %s (details in %s)", HydraConfig.get().job.num, error, path)
    return float("nan")


def entry(task):
    """Wrap a Hydra task: validate the config first, turn MtpError into one line and exit code 2.

    In a multirun (-m) a failing point does not stop the sweep: it leaves FAILED.txt in its run
    directory and returns NaN, and the other points run. While the task runs, the library knows
    which point it is (`mtp_train.tracking.sweep_point`). The command is the name of the entry
    point's file (mtp_train/cli/eval.py: eval, also run as `python -m`); validation judges the keys
    `config_rules.READS` lists for it."""
    if not Path(CONF_DIR, "config.yaml").is_file():
        raise SystemExit(f"mtp_train: config directory {CONF_DIR} not found; install the project "
                         "from its repository with `pip install -e .`")
    command = Path(inspect.getfile(task)).stem
    command = command if command in READS else None

    @functools.wraps(task)
    def wrapper(cfg: DictConfig):
        try:
            if in_multirun():  # a rerun of a point that failed before starts clean
                _failure_file().unlink(missing_ok=True)
            typed = validate(cfg, command=command)
            set_sweep_point(current_point())
            return task(cfg, typed)
        except SystemExit as e:
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            if not isinstance(e, SIGTERMException):  # Lightning's SIGTERM: a SystemExit without a code (0)
                raise
            print("error: stopped by SIGTERM; what was saved is kept (the last checkpoint or finished "
                  "shards): rerun the same command to resume", file=sys.stderr)
            raise SystemExit(143) from None
        except Exception as e:
            if in_multirun():
                return _record_failure(e)
            if isinstance(e, MtpError):
                print(f"error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
            if type(e).__module__.startswith("wandb"):  # W&B refused the key, or its server is out of reach
                print(f"error: W&B: {wandb_failure(e)}", file=sys.stderr)
                raise SystemExit(2) from None
            if (what := write_failure(e)) is not None:
                print(f"error: {what}; nothing unfinished was published (free space or fix permissions, then "
                      "rerun: finished stages are kept)", file=sys.stderr)
                raise SystemExit(2) from None
            raise
        finally:
            set_sweep_point(None)

    return wrapper
