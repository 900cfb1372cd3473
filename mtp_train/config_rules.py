"""How a config is judged: which keys each command reads, the check helpers the schema's
`__post_init__` rules use (a failed check names the full key), the one "k fits the rows" rule, and
`validate`, which every entry point calls first (docs/configuration.md)."""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtp_train.errors import ConfigError

# the config keys (or sections) each command reads; validation judges only these. None: every key
# (scripts, benchmarks and tests that compose a config for several stages)
READS: dict[str, tuple[str, ...]] = {
    "prep": ("seed", "stage", "force", "paths", "backbone", "data", "heads.type", "heads.aux_layers",
             "train.data_use", "train.max_length", "budget.deadline", "budget.distill_share"),
    "train": ("seed", "stage", "force", "paths", "backbone", "data", "heads", "loss", "train", "budget"),  # + eval with train.eval_after
    # calibration decodes eval.max_new_tokens; under budget.deadline it is sized by the evaluation's modes,
    # prompts, rounds and sampled runs (pipeline/budget.py, kinds_to_calibrate)
    "clp": ("seed", "stage", "force", "paths", "backbone", "data", "clp", "eval.max_new_tokens", "eval.modes",
            "eval.n_prompts", "eval.rounds", "eval.sampling", "eval.prompts", "eval.prompt_source",
            "eval.max_prompt_tokens", "train.data_use", "train.max_length", "train.use_cache", "budget"),
    "eval": ("seed", "force", "paths", "backbone", "data", "eval", "budget"),
}
# the commands without stages of their own (mtp-prep and mtp-clp check theirs): `stage` may only be all
ONE_STAGE = {"train": "mtp-train", "eval": "mtp-eval"}
_JUDGED: ContextVar[tuple[str, ...] | None] = ContextVar("judged_keys", default=None)


def _judged(key: str) -> bool:
    keys = _JUDGED.get()
    return keys is None or any(key == k or key.startswith(k + ".") for k in keys)


def check(ok: bool, key: str, msg: str) -> None:
    if not ok and _judged(key):
        raise ConfigError(f"{key}: {msg}")


def check_seed(value: int, key: str) -> None:
    check(0 <= value < 2**32, key, f"must be in [0, 2**32) (numpy and torch seed ranges), got {value}")


def check_choice(value: str, choices: tuple[str, ...], key: str) -> None:
    check(value in choices, key, f"unknown value {value!r}; choose one of {', '.join(choices)}")


def min_row_tokens(k: int) -> int:
    """The shortest row in which each of k heads has a target: depth j at position t predicts token
    t + j + 1, so depth k needs positions t and t + k + 1 inside the row, k + 2 tokens."""
    return k + 2


def check_k_fits(k: int, row_tokens: int, where: str) -> None:
    """The one "k fits the rows" rule: `row_tokens`, the longest row the heads can train on, holds
    at least `min_row_tokens(k)` tokens. At compose time that is the crop length (train.max_length,
    else data.max_length); once the rows are read, the longest of them after cropping. `where`
    names that length in the message."""
    check(row_tokens >= min_row_tokens(k), "heads.k",
           f"{k} heads need rows of at least {min_row_tokens(k)} tokens; {where}; lower heads.k")


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys of `node` that its dataclass schema does not have, as full dotted names with the valid
    ones: Hydra's `+key=value` adds a key to a structured config, and OmegaConf would then set it
    as a stray attribute that nothing reads. Free-form sections (trainer, logger) are not checked."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    names = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key in node.keys():
        if key not in names:
            where = prefix.rstrip(".") or "the top level"
            out.append(f"{prefix}{key}: not a config key (keys of {where}: {', '.join(sorted(names))})")
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            out += unknown_keys(child, f"{prefix}{key}.")
    return out


def judged_keys(cfg: DictConfig, command: str | None) -> tuple[str, ...] | None:
    """The keys `command` reads (`READS`; None: every key). mtp-train reads eval.* only to decode
    after training (train.eval_after)."""
    if command is None:
        return None
    if command not in READS:
        raise ValueError(f"unknown command {command!r}; known: {', '.join(READS)}")
    keys = READS[command]
    if command == "train" and cfg.train.eval_after:
        keys = (*keys, "eval")
    return keys


def validate(cfg: DictConfig, command: str | None = None):
    """Refuse keys the schema lacks, resolve interpolations and run the `__post_init__` checks of
    the keys `command` reads (every key without one); returns the typed object (a config.Config),
    all of it."""
    if stray := unknown_keys(cfg):
        raise ConfigError(stray[0] + (f"; and {len(stray) - 1} more" if len(stray) > 1 else ""))
    if command in ONE_STAGE and cfg.get("stage", "all") != "all":  # a stage name meant for mtp-prep or mtp-clp
        raise ConfigError(f"stage: {ONE_STAGE[command]} has no stages, got stage={cfg.stage!r} (mtp-prep and "
                          "mtp-clp have stages); leave it out or use stage=all")
    token = _JUDGED.set(judged_keys(cfg, command))
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(str(e).splitlines()[0] + _key_suffix(e)) from None
    finally:
        _JUDGED.reset(token)


def _key_suffix(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    return f" (config key: {key})" if key else ""
