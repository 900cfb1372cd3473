"""Objects built from config nodes that name what to call with `_target_` (conf/trainer/,
conf/logger/), without Hydra, so the pipeline runs from a typed config alone.

A node `{_target_: lightning.Trainer, max_steps: 10, strategy: {_target_: ...}}` is called with
its other keys as keyword arguments, nested nodes built first; `_args_` gives positional arguments
and `_partial_: true` returns a functools.partial instead of calling.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping

from mtp_train.errors import ConfigError

_SPECIAL = ("_target_", "_args_", "_partial_")


def locate(path: str):
    """What a dotted path names: `lightning.Trainer`, `mtp_train.distributed.deepspeed_config`."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):  # a dependency of the module is missing
                raise
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise ConfigError(f"_target_: {path!r} names nothing that can be imported")


def _build(node):
    if isinstance(node, Mapping):
        return _call(node, {}) if "_target_" in node else {k: _build(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_build(v) for v in node]
    return node


def _call(node: Mapping, extra: dict):
    target = node["_target_"]
    unknown = [k for k in node if k.startswith("_") and k.endswith("_") and k not in _SPECIAL]
    if unknown:
        raise ConfigError(f"{unknown[0]}: not understood in the node of {target} (only "
                          f"{', '.join(_SPECIAL)} are)")
    fn = locate(target)
    args = [_build(a) for a in node.get("_args_", ())]
    kwargs = {k: _build(v) for k, v in node.items() if k not in _SPECIAL}
    kwargs.update(extra)
    if node.get("_partial_", False):
        return functools.partial(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def instantiate(node: Mapping, **kwargs):
    """`node` built; `kwargs` are passed to its `_target_` as they are, over the node's own keys."""
    if "_target_" not in node:
        raise ConfigError(f"_target_: missing from {dict(node)!r}, which names nothing to build")
    return _call(node, kwargs)
