"""Artifacts on disk: manifests keyed by a config hash, written atomically.

A stage is up to date when its output directory holds a manifest whose `config_hash` equals the hash
of the inputs that produced it; anything else (missing, half-written, other inputs) is rebuilt.
Directories are written under a temporary name and renamed into place, so a killed run never leaves a
directory that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from mtp_train.errors import MtpError
from mtp_train.layout import MANIFEST


def config_hash(obj: Any) -> str:
    """Stable short hash of a JSON-able object (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk, the target a directory: no half-written temporary stays behind
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")




def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing or half-written; a directory (or other
    non-file) where the record belongs is refused naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as e:
        raise MtpError(f"{path}: cannot be read as a JSON record ({type(e).__name__}); move it away and "
                       "rerun the stage that writes it") from None


def read_weights_meta(directory: Path, meta_name: str, weights_name: str, written_by: str
                      ) -> tuple[dict, Path, Path]:
    """(the parsed JSON, its path, the weights' path) of a directory holding a JSON record beside a
    safetensors file, refused naming the file when either is missing or the JSON is damaged."""
    d = Path(directory)
    meta_file, weights = d / meta_name, d / weights_name
    if not meta_file.is_file() or not weights.is_file():
        raise MtpError(f"{d}: expected {weights_name} and {meta_name} ({written_by})")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise MtpError(f"{meta_file}: not valid JSON ({e.msg}, line {e.lineno})") from None
    return meta, meta_file, weights


def load_weights(path: Path) -> dict:
    """A safetensors file's tensors, refused naming the file when it is unreadable or holds NaN / inf."""
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors reports truncation and bad headers as several error types
        raise MtpError(f"{path}: not a readable safetensors file ({e})") from None
    check_finite(state, str(path))
    return state


def check_state_matches(state: dict, expected: dict, where: str) -> None:
    """Refuse a loaded state whose tensors would load wrongly into `expected` (a module's own
    state_dict): a shape that differs, or an integer tensor where a float one belongs (torch would
    cast it silently: weights saved as int32 load as all zeros) or a float where an index map
    belongs. Names the first such tensor."""
    for name, t in state.items():
        want = expected.get(name)
        if want is None:
            continue
        if tuple(t.shape) != tuple(want.shape):
            raise MtpError(f"{where}: {name} has shape {list(t.shape)}, these heads expect {list(want.shape)}")
        if t.is_floating_point() != want.is_floating_point():
            kind = "floating-point" if want.is_floating_point() else "integer"
            raise MtpError(f"{where}: {name} is {str(t.dtype).removeprefix('torch.')}, these heads expect a {kind} "
                           f"tensor ({str(want.dtype).removeprefix('torch.')}); the file was not written by mtp-train, "
                           "or was converted wrongly")


def read_manifest(directory: Path) -> dict | None:
    return read_json(Path(directory) / MANIFEST)


def is_up_to_date(directory: Path, wanted_hash: str) -> bool:
    m = read_manifest(directory)
    return m is not None and m.get("config_hash") == wanted_hash


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def temp_dir_for(final: Path) -> Path:
    """<final>.tmp-<pid>, empty; the unfinished temporaries of processes that died (a kill, a full
    disk) beside it are removed, those of live ones (a concurrent writer) are left alone."""
    final = Path(final)
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if final.parent.is_dir():
        for old in final.parent.glob(final.name + ".tmp-*"):
            pid = old.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a finished temporary directory into place, replacing an older version."""
    final = Path(final)
    if final.exists():
        old = final.with_name(final.name + f".old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)  # left by a killed run with the same pid
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def hash_file(path: Path, h):
    """Feed a file to the hash object `h` (hashlib's or xxhash's) in 16 MiB blocks; returns its hex digest."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    import hashlib

    return hash_file(path, hashlib.sha256())


def check_finite(tensors: dict, where: str) -> None:
    """Refuse weights with NaN or inf (a diverged fit, a damaged file), naming the first such tensor;
    integer tensors (index maps) are not checked."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise MtpError(f"{where}: {name} has {bad:,} non-finite values of {t.numel():,}")


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """A matplotlib figure written to a temporary file beside `path`, then moved over it: a symlink
    at `path` is replaced, never written through (the file it points to is not ours), and a reader
    never sees half a PNG."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)
    return path
