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

import os
from pathlib import Path

import numpy as np

from mtp_train.artifacts import config_hash, read_json, read_manifest
from mtp_train.errors import DataError
from mtp_train.layout import MANIFEST

SPLITS = ("train", "validation")
NP_DTYPES = {"float16": np.float16, "float32": np.float32}
# 2: hidden states + backbone stats; 3: + a digest of every shard file in the manifest (required);
# bump when the stored layout changes (the key holds it: caches of another format are rebuilt)
FORMAT = 3
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


def file_digest(path: Path) -> str:
    """xxh3-64 of a file's bytes (several GB/s: the whole cache is checked every time it is opened)."""
    import xxhash

    from mtp_train.artifacts import hash_file

    return hash_file(path, xxhash.xxh3_64())


def shard_digests(out: Path) -> dict[str, str]:
    """{file name: digest} of every shard and sidecar in a cache directory (what its manifest records)."""
    return {f.name: file_digest(f) for f in sorted(Path(out).glob("*.npy")) if ".tmp-" not in f.name}


SIDECARS = ("offsets", "stats", "top", "aux")  # the files beside each shard's hidden states ("aux" optional)


def sidecar(hidden_file: Path, what: str) -> Path:
    return hidden_file.with_name(f"{hidden_file.stem}.{what}.npy")


def _first_non_finite(arr: np.ndarray, chunk: int = 1 << 16) -> int | None:
    """The first row of `arr` (tokens, ...) holding NaN or inf, None when all are finite; read in chunks of
    rows, so a memory-mapped shard is never copied whole."""
    for start in range(0, arr.shape[0], chunk):
        bad = ~np.isfinite(arr[start:start + chunk])
        if bad.any():
            return start + int(np.argwhere(bad)[0][0])
    return None


_VERIFIED: set[tuple[str, str, str]] = set()  # caches whose digests this process has checked


class HiddenCache:
    """Memory-mapped read access: `cache.row(split, i)` -> (T_i, d) hidden states,
    `cache.stats(split, i)` -> {"lse", "entropy": (T_i,) float32, "top": (T_i,) int32},
    `cache.aux(split, i)` -> (T_i, n_aux * d) when the cache was built with auxiliary layers.

    Every shard is checked when the cache is opened (`_check_shard`): files that load, widths and
    dtypes the manifest names, offsets that cut the shard into its rows, greedy token ids inside
    the vocabulary (`vocab_size`, when the caller knows it), and as many rows as the manifest says;
    a damaged cache is refused in one line naming the file, never trained on."""

    def __init__(self, path: Path, vocab_size: int | None = None):
        self.path = Path(path)
        self.manifest = read_json(self.path / MANIFEST)
        if self.manifest is None:
            raise DataError(f"{self.path}: not a finished hidden-state cache; run `mtp-prep stage=cache`")
        self.vocab_size = vocab_size if vocab_size is not None else self.manifest.get("vocab_size")
        # the digests are read once per cache and process, and on one rank per node (the others and
        # a second open in the same process trust that check)
        if not isinstance(self.manifest.get("digests"), dict) or not self.manifest["digests"]:
            raise self._damaged(self.path / MANIFEST, "the manifest records no digest of its shard files (every "
                                "cache written since format 3 does): its contents cannot be checked")
        stamp = (str(self.path.resolve()), str(self.manifest.get("config_hash")), str(self.manifest.get("digests")))
        self._verify = stamp not in _VERIFIED and os.environ.get("LOCAL_RANK", "0") == "0"
        self._splits = {s: self._open(s) for s in SPLITS}
        _VERIFIED.add(stamp)

    def _damaged(self, where: Path, what: str) -> DataError:
        return DataError(f"{where}: {what}; the cache at {self.path} is damaged: delete it and run "
                         "`mtp-prep stage=cache` again")

    def _load(self, f: Path, mmap: bool = True) -> np.ndarray:
        want = self.manifest["digests"].get(f.name, "not recorded")
        if self._verify and f.is_file() and file_digest(f) != want:
            raise self._damaged(f, "its contents changed after the cache was built (the digest in the "
                                   "manifest differs)")
        try:
            return np.load(f, mmap_mode="r" if mmap else None, allow_pickle=False)
        except FileNotFoundError:
            raise self._damaged(f, "missing (every shard has offsets, stats and top files beside it)") from None
        except (ValueError, OSError, EOFError) as e:  # truncated, a bad header, an object array
            raise self._damaged(f, f"not a readable .npy array ({e})") from None

    def _open(self, split: str):
        shards, i = [], 0
        while (f := shard_file(self.path, split, i)).is_file():
            aux = sidecar(f, "aux")
            shard = (self._load(f), self._load(offsets_file(f), mmap=False), self._load(sidecar(f, "stats")),
                     self._load(sidecar(f, "top")), self._load(aux) if aux.is_file() else None)
            self._check_shard(f, *shard)
            shards.append(shard)
            i += 1
        # shards may hold different numbers of rows (distillation's do): the first row of each
        first = np.cumsum([0] + [len(sh[1]) - 1 for sh in shards])
        want = (self.manifest.get("rows") or {}).get(split)
        if want is not None and int(first[-1]) != want:
            raise self._damaged(shard_file(self.path, split, i), f"{split} has {int(first[-1])} rows in "
                                f"{i} shard(s) up to this missing one, the manifest says {want}")
        return shards, first

    def _check_shard(self, f: Path, hidden, offsets, stats, top, aux) -> None:
        m = self.manifest
        width, dtype = m.get("hidden_size"), m.get("dtype", STATES_DTYPE)
        if hidden.ndim != 2 or (width is not None and hidden.shape[1] != width) or str(hidden.dtype) != dtype:
            raise self._damaged(f, f"hidden states {hidden.dtype} of shape {list(hidden.shape)}, the manifest "
                                f"says {dtype} (tokens, {width})")
        n = hidden.shape[0]
        o = offsets_file(f)
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 2:
            raise self._damaged(o, f"offsets must be a 1-D integer array of rows + 1 entries, got "
                                f"{offsets.dtype} of shape {list(offsets.shape)}")
        decreasing = bool((np.diff(offsets) < 0).any())
        if offsets[0] != 0 or offsets[-1] != n or decreasing:
            raise self._damaged(o, f"offsets do not cut the shard's {n} tokens into rows (first {int(offsets[0])}, "
                                f"last {int(offsets[-1])}{', decreasing' if decreasing else ''})")
        if stats.shape != (n, 2) or stats.dtype.kind != "f":
            raise self._damaged(sidecar(f, "stats"), f"stats {stats.dtype} of shape {list(stats.shape)}, "
                                f"expected float ({n}, 2)")
        if top.shape != (n,) or top.dtype.kind not in "iu":
            raise self._damaged(sidecar(f, "top"), f"greedy tokens {top.dtype} of shape {list(top.shape)}, "
                                f"expected integer ({n},)")
        if n and (int(top.min()) < 0 or (self.vocab_size is not None and int(top.max()) >= self.vocab_size)):
            bad = int(top.min()) if int(top.min()) < 0 else int(top.max())
            raise self._damaged(sidecar(f, "top"), f"greedy token id {bad} outside the vocabulary "
                                f"[0, {self.vocab_size if self.vocab_size is not None else '?'})")
        if self._verify:  # with the digests: a cache built from a backbone that overflowed is named, not trained on
            for what, arr, where in (("hidden states", hidden, f), ("stats", stats, sidecar(f, "stats")),
                                     ("auxiliary states", aux, sidecar(f, "aux"))):
                if arr is not None and (row := _first_non_finite(arr)) is not None:
                    raise self._damaged(where, f"{what} hold NaN or inf at token {row} (the backbone's output "
                                        "when the cache was built overflowed, or the file was edited)")
        layers = m.get("aux_layers")
        if layers and (aux is None or aux.ndim != 2 or aux.shape[0] != n
                       or (width is not None and aux.shape[1] != len(layers) * width)):
            got = "missing" if aux is None else f"of shape {list(aux.shape)}"
            raise self._damaged(sidecar(f, "aux"), f"auxiliary states {got}, expected ({n}, "
                                f"{len(layers)} x {width}) for layers {layers}")

    def lengths(self, split: str) -> np.ndarray:
        """Every row's number of tokens, in row order."""
        shards, _ = self._splits[split]
        return np.concatenate([np.diff(sh[1]) for sh in shards]) if shards else np.zeros(0, np.int64)

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
