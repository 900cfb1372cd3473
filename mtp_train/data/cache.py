"""Hidden-state cache: run the frozen backbone once, train the heads many times.

Every loss needs only the backbone's final hidden states h_t and three numbers per position that
summarise its full-vocabulary distribution (`teacher.backbone_stats`: log-normaliser, greedy token,
entropy): with them the teacher over a draft vocabulary is one |D|-column matmul and training never
touches the V-sized logits. So `mtp-prep stage=cache` stores, for every token of the training data,
h (float16 by default, d x 2 bytes: 1,152 for SmolLM2) and the stats (12 bytes), in shards of rows
written atomically (a killed run resumes from its last shard), as .npy files that training
memory-maps (no pickle, nothing loaded whole).

The cache directory is keyed by the hash of the datasets' manifests, the backbone's identity, the
row length and the dtype: a changed input gets a new key, so a stale cache is never read.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mtp_train.artifacts import MANIFEST, config_hash, read_json, read_manifest, write_json_atomic
from mtp_train.errors import DataError

log = logging.getLogger(__name__)
SPLITS = ("train", "validation")
NP_DTYPES = {"float16": np.float16, "float32": np.float32}
FORMAT = 2  # 2: hidden states + backbone stats; bump when the stored layout changes


def cache_key(data_dirs: list[Path], backbone_identity: dict | None, max_length: int, dtype: str) -> str:
    manifests = []
    for d in data_dirs:
        m = read_manifest(d)
        if m is None:
            raise DataError(f"{d}: no prepared dataset here; run `mtp-prep` first")
        manifests.append(m["config_hash"])
    return config_hash({"data": manifests, "backbone": backbone_identity, "max_length": max_length,
                        "dtype": dtype, "format": FORMAT})


def cache_path(base: Path, key: str) -> Path:
    return Path(base) / f"cache-{key}"


def _shard_file(out: Path, split: str, idx: int) -> Path:
    return out / f"{split}-{idx:05d}.npy"


@torch.no_grad()
def build_cache(splits: dict, backbone, out: Path, key: str, max_length: int, dtype: str = "float16",
                shard_rows: int = 256, batch_size: int = 8) -> dict:
    """Hidden states of every row of `splits` ({split: dataset with input_ids}) into `out`."""
    out = Path(out)
    if (m := read_manifest(out)) is not None and m.get("config_hash") == key:
        log.info("cache: %s is up to date", out)
        return m
    out.mkdir(parents=True, exist_ok=True)
    t0, tokens = time.time(), 0
    total = sum(len(splits[s]) for s in SPLITS)
    bar = tqdm(total=total, unit="row", desc="hidden-state cache", dynamic_ncols=True)
    for split in SPLITS:
        rows = splits[split]
        for idx, start in enumerate(range(0, len(rows), shard_rows)):
            end = min(start + shard_rows, len(rows))
            final = _shard_file(out, split, idx)
            if final.is_file():  # finished by an earlier (killed) run
                bar.update(end - start)
                continue
            ids = [list(r)[:max_length] for r in rows.select(range(start, end))["input_ids"]]
            parts = []
            for b in range(0, len(ids), batch_size):  # the bar moves per batch, not per shard
                parts.append(_hidden_rows(backbone, ids[b: b + batch_size], dtype))
                bar.update(len(ids[b: b + batch_size]))
            hidden = np.concatenate([p[0] for p in parts])  # (tokens, d)
            offsets = np.cumsum([0] + [len(x) for x in ids]).astype(np.int64)  # (rows + 1,)
            tmp = final.with_name(final.name + f".tmp-{os.getpid()}.npy")
            np.save(tmp, hidden)
            np.save(_offsets_file(final), offsets)
            np.save(_sidecar(final, "stats"), np.concatenate([p[1] for p in parts]))  # (tokens, 2)
            np.save(_sidecar(final, "top"), np.concatenate([p[2] for p in parts]))  # (tokens,)
            os.replace(tmp, final)  # the hidden file last: its presence marks the shard done
            tokens += hidden.shape[0]
    bar.close()
    stored = sum(f.stat().st_size for f in out.glob("*.npy"))
    n_tokens = sum(int(np.load(f, mmap_mode="r").shape[0]) for f in out.glob("*-?????.npy"))
    manifest = {"stage": "cache", "config_hash": key, "format": FORMAT, "dtype": dtype,
                "max_length": max_length,
                "hidden_size": backbone.hidden_size,
                "rows": {s: len(splits[s]) for s in SPLITS}, "shard_rows": shard_rows,
                "tokens": n_tokens, "bytes": stored,
                "bytes_per_token": round(stored / max(1, n_tokens), 1),
                "elapsed_s_this_run": round(time.time() - t0, 1),
                "tokens_per_s_this_run": round(tokens / max(time.time() - t0, 1e-9), 1)}
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def _offsets_file(hidden_file: Path) -> Path:
    return _sidecar(hidden_file, "offsets")


def _sidecar(hidden_file: Path, what: str) -> Path:
    return hidden_file.with_name(f"{hidden_file.stem}.{what}.npy")


def _hidden_rows(backbone, ids: list[list[int]], dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One right-padded batch -> the real positions' hidden states (tokens, d), stats (tokens, 2)
    float32 [lse, entropy] and greedy tokens (tokens,) int32, rows concatenated."""
    from mtp_train.teacher import backbone_stats

    T = max(len(x) for x in ids)
    inp = torch.zeros((len(ids), T), dtype=torch.long)
    attn = torch.zeros((len(ids), T), dtype=torch.long)
    for i, x in enumerate(ids):
        inp[i, : len(x)] = torch.as_tensor(x)
        attn[i, : len(x)] = 1
    h = backbone.hidden_states(inp.to(backbone.device), attn.to(backbone.device))  # (B, T, d)
    st = {k: v.cpu() for k, v in backbone_stats(backbone.logits(h)).items()}  # (B, T) each
    real = attn.bool()  # (B, T); rows are right-padded, so this keeps each row's tokens in order
    stats = torch.stack([st["lse"][real], st["entropy"][real]], -1).numpy()  # (tokens, 2)
    return (h.float().cpu()[real].numpy().astype(NP_DTYPES[dtype]), stats,
            st["top"][real].numpy().astype(np.int32))


class HiddenCache:
    """Memory-mapped read access: `cache.row(split, i)` -> (T_i, d) hidden states,
    `cache.stats(split, i)` -> {"lse", "entropy": (T_i,) float32, "top": (T_i,) int32}."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.manifest = read_json(self.path / MANIFEST)
        if self.manifest is None:
            raise DataError(f"{self.path}: not a finished hidden-state cache; run `mtp-prep stage=cache`")
        self._splits = {s: self._open(s) for s in SPLITS}

    def _open(self, split: str):
        shards, i = [], 0
        while (f := _shard_file(self.path, split, i)).is_file():
            shards.append((np.load(f, mmap_mode="r", allow_pickle=False),
                           np.load(_offsets_file(f), allow_pickle=False),
                           np.load(_sidecar(f, "stats"), mmap_mode="r", allow_pickle=False),
                           np.load(_sidecar(f, "top"), mmap_mode="r", allow_pickle=False)))
            i += 1
        return shards

    def _locate(self, split: str, i: int):
        rows_per = self.manifest["shard_rows"]
        shard = self._splits[split][i // rows_per]
        offsets, j = shard[1], i % rows_per
        return shard, slice(int(offsets[j]), int(offsets[j + 1]))

    def row(self, split: str, i: int) -> np.ndarray:
        shard, span = self._locate(split, i)
        return shard[0][span]

    def stats(self, split: str, i: int) -> dict[str, np.ndarray]:
        shard, span = self._locate(split, i)
        return {"lse": shard[2][span, 0], "entropy": shard[2][span, 1], "top": shard[3][span]}
