"""What every entry point shares: the conf/ directory, config validation, clean error messages."""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from mtp_train.config import register_configs, validate
from mtp_train.errors import MtpError

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
log = logging.getLogger("mtp_train")

register_configs()
# never let W&B or the hub block a run on a prompt or a network call on these machines
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def entry(task):
    """Wrap a Hydra task: validate the config first, turn MtpError into one line and exit code 2."""
    if not Path(CONF_DIR, "config.yaml").is_file():
        raise SystemExit(f"mtp_train: config directory {CONF_DIR} not found; install the project "
                         "from its repository with `pip install -e .`")

    @functools.wraps(task)
    def wrapper(cfg: DictConfig):
        try:
            typed = validate(cfg)
            return task(cfg, typed)
        except MtpError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper
