"""Checkpoints published only once they are whole.

Lightning's own writer saves into a temporary file in the system's temp directory and then moves
it over the target; across filesystems that move is a copy, and a full disk during it leaves a
truncated last.ckpt with the previous good one already gone. `AtomicCheckpointIO` writes a
temporary beside the target, flushes it to disk and renames it over the target: a failed write
leaves the previous checkpoint as it was. Temporaries that killed processes left (a Slurm time
limit, kill -9) are removed by the next write. A module-level class, so that trainers that are
pickled (ddp_spawn) can carry it.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.plugins.io import TorchCheckpointIO

from mtp_train.artifacts import pid_alive


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        import torch

        if storage_options is not None:
            raise TypeError("storage_options is not supported by AtomicCheckpointIO")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(f"{path.name}.tmp-*"):  # left by a process that was killed
            pid = old.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not pid_alive(int(pid)):
                old.unlink(missing_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
