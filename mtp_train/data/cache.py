"""Hidden-state cache, the reading side (data_prep/cache.py builds it): run the frozen backbone once,
train the heads many times.

Every loss needs only the backbone's final hidden states h_t and three numbers per position that
summarise its full-vocabulary distribution (`teacher.backbone_stats`: log-normaliser, greedy token,
entropy): with them the teacher over a draft vocabulary is one |D|-column matmul and training never
touches the V-sized logits. So `mtp-prep stage=cache` stores, for every token of the training data,
h (float16 by default, d x 2 bytes: 1,152 for SmolLM2) and the stats (12 bytes), in shards of rows
written atomically (a killed run resumes from its last shard), as .npy files that training
memory-maps (no pickle, nothing loaded whole).

The cache directory is keyed by the hash of the datasets' manifests, the backbone's identity, the
row length and the dtype: a changed input gets a new key, so a stale cache is never read.

Heads that read more of the backbone than its final state (EAGLE-3 fuses the inputs of three decoder
layers) need those states too: with `aux_layers` the cache also stores them, concatenated, as an
`.aux.npy` sidecar per shard ((tokens, n * d), same dtype), and the layer ids join the key.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtp_train.artifacts import config_hash, read_json, read_manifest
from mtp_train.errors import DataError
from mtp_train.layout import MANIFEST

SPLITS = ("train", "validation")
NP_DTYPES = {"float16": np.float16, "float32": np.float32}
FORMAT = 2  # 2: hidden states + backbone stats; bump when the stored layout changes
STATES_DTYPE = "float16"  # how hidden states are stored


def cache_key(data_dirs: list[Path], backbone_identity: dict | None, max_length: int, dtype: str,
              compute: str = "float32", aux_layers: list[int] | None = None) -> str:
    manifests = []
    for d in data_dirs:
        m = read_manifest(d)
        if m is None:
            raise DataError(f"{d}: no prepared dataset here; run `mtp-prep` first")
        manifests.append(m["config_hash"])
    key = {"data": manifests, "backbone": backbone_identity, "max_length": max_length,
           "dtype": dtype, "compute": compute, "format": FORMAT}
    if aux_layers:  # absent otherwise, so the caches of the other head families keep their keys
        key["aux_layers"] = [int(i) for i in aux_layers]
    return config_hash(key)


def shard_file(out: Path, split: str, idx: int) -> Path:
    return out / f"{split}-{idx:05d}.npy"


# A row's stored states: hidden (T, d) in the storage dtype, stats (T, 2) float32 [lse, entropy],
# greedy tokens (T,) int32 (+ auxiliary states (T, n * d) when the cache stores them)
RowStates = tuple[np.ndarray, ...]


def offsets_file(hidden_file: Path) -> Path:
    return sidecar(hidden_file, "offsets")


def sidecar(hidden_file: Path, what: str) -> Path:
    return hidden_file.with_name(f"{hidden_file.stem}.{what}.npy")


class HiddenCache:
    """Memory-mapped read access: `cache.row(split, i)` -> (T_i, d) hidden states,
    `cache.stats(split, i)` -> {"lse", "entropy": (T_i,) float32, "top": (T_i,) int32},
    `cache.aux(split, i)` -> (T_i, n_aux * d) when the cache was built with auxiliary layers."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.manifest = read_json(self.path / MANIFEST)
        if self.manifest is None:
            raise DataError(f"{self.path}: not a finished hidden-state cache; run `mtp-prep stage=cache`")
        self._splits = {s: self._open(s) for s in SPLITS}

    def _open(self, split: str):
        shards, i = [], 0
        while (f := shard_file(self.path, split, i)).is_file():
            aux = sidecar(f, "aux")
            shards.append((np.load(f, mmap_mode="r", allow_pickle=False),
                           np.load(offsets_file(f), allow_pickle=False),
                           np.load(sidecar(f, "stats"), mmap_mode="r", allow_pickle=False),
                           np.load(sidecar(f, "top"), mmap_mode="r", allow_pickle=False),
                           np.load(aux, mmap_mode="r", allow_pickle=False) if aux.is_file() else None))
            i += 1
        # shards may hold different numbers of rows (distillation's do): the first row of each
        first = np.cumsum([0] + [len(sh[1]) - 1 for sh in shards])
        return shards, first

    def _locate(self, split: str, i: int):
        shards, first = self._splits[split]
        if not 0 <= i < first[-1]:
            raise IndexError(f"{self.path}: {split} has {first[-1]} rows, asked for row {i}")
        s = int(np.searchsorted(first, i, side="right")) - 1
        offsets, j = shards[s][1], i - int(first[s])
        return shards[s], slice(int(offsets[j]), int(offsets[j + 1]))

    def states(self, split: str, i: int) -> RowStates:
        shard, span = self._locate(split, i)
        return shard[0][span], shard[2][span], shard[3][span]

    def row(self, split: str, i: int) -> np.ndarray:
        shard, span = self._locate(split, i)
        return shard[0][span]

    @property
    def aux_layers(self) -> list[int] | None:
        return self.manifest.get("aux_layers")

    def aux(self, split: str, i: int) -> np.ndarray:
        """(T_i, n_aux * d): the inputs of the `aux_layers` decoder layers, concatenated."""
        shard, span = self._locate(split, i)
        if shard[4] is None:
            raise DataError(f"{self.path}: this cache holds no auxiliary layer states; heads=eagle3 "
                            "needs `mtp-prep stage=cache heads=eagle3` (the layer ids are part of its key)")
        return shard[4][span]

    def stats(self, split: str, i: int) -> dict[str, np.ndarray]:
        shard, span = self._locate(split, i)
        return {"lse": shard[2][span, 0], "entropy": shard[2][span, 1], "top": shard[3][span]}
