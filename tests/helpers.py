"""What a user runs before mtp-train and mtp-eval with the tiny backbone: `mtp-prep` (mtp_train never
prepares data itself; data_prep/ does). The tests' train/eval calls go through these."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from data_prep.stages import run_prep
from mtp_train.pipeline.evaluation import run_eval as _run_eval
from mtp_train.pipeline.training import run_train as _run_train

BIN = Path(sys.executable).parent


def prepare_tiny(cfg) -> None:
    """The data (and self-distilled answers, when training reads them) of the in-code tiny source."""
    if cfg.data.source == "tiny":
        for stage in ["data"] + (["distill"] if cfg.train.data_use != "labelled" else []):
            run_prep(dataclasses.replace(cfg, stage=stage))


def run_train(cfg) -> dict:
    prepare_tiny(cfg)
    return _run_train(cfg)


def run_eval(cfg) -> dict:
    if not cfg.eval.prompts:
        prepare_tiny(cfg)
    return _run_eval(cfg)


def prep_cli(*overrides: str, cwd=None) -> None:
    """`mtp-prep stage=all` with the overrides a following mtp-train subprocess gets."""
    r = subprocess.run([str(BIN / "mtp-prep"), "stage=all", *overrides], cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


class Killed(Exception):
    """Stands for a kill: raised by `train_killed_at` at the step it names."""


def train_killed_at(cfg, step: int, monkeypatch) -> None:
    """mtp-train on `cfg`, dying (Killed) when the trainer reaches `step`; the training step is
    restored afterwards, so the next run_train on the same directory resumes as after a kill."""
    import pytest

    from mtp_train.lit.module import MTPHeadsModule

    real_step = MTPHeadsModule.training_step

    def dying_step(self, batch, batch_idx):
        if self.global_step == step:
            raise Killed
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(MTPHeadsModule, "training_step", dying_step)
    try:
        with pytest.raises(Killed):
            run_train(cfg)
    finally:
        monkeypatch.setattr(MTPHeadsModule, "training_step", real_step)


def wandb_offline_runs(directory) -> list[dict]:
    """The run records of every W&B offline run under `directory` (<dir>/**/offline-run-*/run-*.wandb):
    name, group, tags, job type and project, read back from the run file itself.

    The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each a 7-byte
    header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of one serialized
    `Record` protobuf."""
    import struct

    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted(Path(directory).rglob("offline-run-*/run-*.wandb")):
        data, pos, block, records, pending = path.read_bytes(), 7, 32768, [], b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # too little room left in this block for a chunk header
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                break
            piece, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending = piece if kind in (1, 2) else pending + piece
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
        for record in records:
            if record.WhichOneof("record_type") == "run":
                r = record.run
                runs.append({"path": str(path), "name": r.display_name, "group": r.run_group,
                             "tags": list(r.tags), "job_type": r.job_type, "project": r.project})
                break
    return runs


class ChainScript:
    """A drafter for tests that drafts one scripted token per depth (probability 0.5) through the
    drafter protocol (mtp_train/decoding/drafters/): subclasses say which token depth j drafts,
    `token(j)`, after `begin` stored the committed tokens."""

    def __init__(self, k: int, vocab: int):
        self.k, self.vocab = k, vocab

    def to_tokens(self, idx):
        return idx

    def reset(self) -> None:
        pass

    def begin(self, tokens, hidden, aux=None) -> None:
        self.committed = tokens.tolist()

    def token(self, j: int) -> int:
        raise NotImplementedError

    def level(self, j: int, expand: list[int], tree):
        import math

        import torch

        row = torch.full((self.vocab,), -math.inf)
        row[self.token(j)] = math.log(0.5)
        return row.expand(len(expand), -1)
