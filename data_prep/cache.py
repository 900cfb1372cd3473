"""Hidden-state cache, the building side: `mtp-prep stage=cache` runs the backbone over the rows
mtp-train reads and stores what `mtp_train.data.cache.HiddenCache` reads back (the layout, the key
and why are described there)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mtp_train.artifacts import pid_alive, read_manifest, write_json_atomic
from mtp_train.backbone import autocast_to
from mtp_train.data.cache import (
    FORMAT,
    NP_DTYPES,
    SIDECARS,
    SPLITS,
    STATES_DTYPE,
    HiddenCache,
    RowStates,
    offsets_file,
    shard_digests,
    shard_file,
    sidecar,
)
from mtp_train.layout import MANIFEST, STATES

log = logging.getLogger(__name__)


def reusable_states(data_dirs: list[Path], backbone_identity: dict | None, compute: str,
                    dtype: str = STATES_DTYPE) -> Callable[[str, int], RowStates | None] | None:
    """(split, i) over the rows of `data_dirs` concatenated (as `load_splits` does) -> the row's
    states when a stage before stored them (`<dir>/states`, written by self-distillation) with this
    backbone, compute dtype and storage dtype, else None. None when no directory has such states."""
    from mtp_train.data.prepared import reached_train_rows

    parts, any_states = [], False
    reached = reached_train_rows(data_dirs)
    for d in data_dirs:
        rows = (read_manifest(d) or {}).get("splits") or {}
        sm = read_manifest(Path(d) / STATES)
        ok = (sm is not None and sm.get("backbone") == backbone_identity and sm.get("compute") == compute
              and sm.get("dtype") == dtype and sm.get("rows") == rows and bool(sm.get("digests")))
        if sm is not None and not ok:
            log.info("cache: the states in %s were made otherwise (%s); recomputing those rows",
                     Path(d) / STATES, {k: sm.get(k) for k in ("compute", "dtype")})
        if (n := reached.get(Path(d))) is not None:  # the rows load_splits reads of it
            rows = {**rows, "train": min(rows.get("train", 0), n)}
        parts.append((rows, HiddenCache(Path(d) / STATES) if ok else None))
        any_states |= ok
    if not any_states:
        return None

    def get(split: str, i: int) -> RowStates | None:
        for rows, states in parts:
            if i < rows.get(split, 0):
                return states.states(split, i) if states is not None else None
            i -= rows.get(split, 0)
        return None

    return get


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Row indices in batches of similar length, longest first: a batch's rows x its longest row
    stays within `batch_tokens` (a longer row goes alone), so right-padding wastes little."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.no_grad()
def build_cache(splits: dict, backbone, out: Path, key: str, max_length: int, dtype: str = STATES_DTYPE,
                shard_rows: int = 256, batch_tokens: int = 4096, compute: str = "float32",
                known: Callable[[str, int], RowStates | None] | None = None,
                aux_layers: list[int] | None = None) -> dict:
    """Hidden states of every row of `splits` ({split: dataset with input_ids}) into `out`.

    Rows are run in batches of similar length (`length_batches`) under autocast to `compute`;
    `known(split, i)` may hand over a row's states computed earlier (self-distillation keeps the
    states of the rows it generates), which are then cropped and stored instead of recomputed.
    With `aux_layers` the inputs of those decoder layers are stored too (`.aux.npy`); distillation
    kept no such states, so every row is run then."""
    out = Path(out)
    if (m := read_manifest(out)) is not None and m.get("config_hash") == key:
        log.info("cache: %s is up to date", out)
        return m
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.npy.tmp-*.npy"):  # a shard a killed run left half-written (write_shard)
        pid = old.name.rsplit("tmp-", 1)[-1].removesuffix(".npy")
        if pid.isdigit() and not pid_alive(int(pid)):
            old.unlink(missing_ok=True)
    if aux_layers:
        known = None
    t0, computed, reused = time.time(), 0, 0
    total = sum(len(splits[s]) for s in SPLITS)
    bar = tqdm(total=total, unit="row", desc="hidden-state cache", dynamic_ncols=True)
    for split in SPLITS:
        rows = splits[split]
        for idx, start in enumerate(range(0, len(rows), shard_rows)):
            end = min(start + shard_rows, len(rows))
            final = shard_file(out, split, idx)
            if final.is_file():  # finished by an earlier (killed) run
                bar.update(end - start)
                continue
            ids = [list(r)[:max_length] for r in rows.select(range(start, end))["input_ids"]]
            states: dict[int, RowStates] = {}
            for j in range(len(ids)):
                got = known(split, start + j) if known is not None else None
                if got is not None and len(got[0]) >= len(ids[j]):
                    states[j] = tuple(a[: len(ids[j])] for a in got)  # causal: a prefix's states
                    reused += len(ids[j])
            bar.update(len(states))
            todo = [j for j in range(len(ids)) if j not in states]
            for batch in length_batches([len(ids[j]) for j in todo], batch_tokens):
                rows_b = [todo[i] for i in batch]
                done = _hidden_rows(backbone, [ids[j] for j in rows_b], dtype, compute, aux_layers)
                for j, st in zip(rows_b, done, strict=True):
                    states[j] = st
                    computed += len(ids[j])
                bar.update(len(rows_b))
            hidden = np.concatenate([states[j][0] for j in range(len(ids))])  # (tokens, d)
            offsets = np.cumsum([0] + [len(x) for x in ids]).astype(np.int64)  # (rows + 1,)
            write_shard(final, hidden, offsets, np.concatenate([states[j][1] for j in range(len(ids))]),
                        np.concatenate([states[j][2] for j in range(len(ids))]),
                        np.concatenate([states[j][3] for j in range(len(ids))]) if aux_layers else None)
    bar.close()
    elapsed = time.time() - t0
    shards = [shard_file(out, s, i) for s in SPLITS for i in range(-(-len(splits[s]) // shard_rows))]
    stored = sum(f.stat().st_size for sh in shards for f in (sh, *(sidecar(sh, w) for w in SIDECARS))
                 if f.is_file())  # the shards themselves: never a temporary file beside them
    n_tokens = sum(int(np.load(f, mmap_mode="r").shape[0]) for f in shards)
    manifest = {"stage": "cache", "config_hash": key, "format": FORMAT, "dtype": dtype,
                "compute": compute, "max_length": max_length,
                "hidden_size": backbone.hidden_size, "vocab_size": backbone.vocab_size, "aux_layers": list(aux_layers) if aux_layers else None,
                "rows": {s: len(splits[s]) for s in SPLITS}, "shard_rows": shard_rows,
                "batch_tokens": batch_tokens,
                "tokens": n_tokens, "bytes": stored, "digests": shard_digests(out),
                "bytes_per_token": round(stored / max(1, n_tokens), 1),
                "elapsed_s_this_run": round(elapsed, 1),
                "tokens_computed_this_run": computed, "tokens_reused_this_run": reused,
                "tokens_per_s_this_run": round((computed + reused) / max(elapsed, 1e-9), 1)}
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def write_shard(final: Path, hidden: np.ndarray, offsets: np.ndarray, stats: np.ndarray,
                top: np.ndarray, aux: np.ndarray | None = None) -> None:
    """One shard: hidden (tokens, d), offsets (rows + 1,), stats (tokens, 2), top (tokens,) and
    optionally aux (tokens, n * d). The hidden file is written last, under a temporary name: its
    presence marks the shard done."""
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}.npy")
    np.save(tmp, hidden)
    np.save(offsets_file(final), offsets)
    np.save(sidecar(final, "stats"), stats)
    np.save(sidecar(final, "top"), top)
    if aux is not None:
        np.save(sidecar(final, "aux"), aux)
    os.replace(tmp, final)


def batch_states(hidden: list[torch.Tensor], lm_head, dtype: str,
                 aux: list[torch.Tensor] | None = None) -> list[RowStates]:
    """Rows' final hidden states [(T_i, d)] (and auxiliary states [(T_i, n * d)]) -> what the cache
    stores for each. The stats come from one pass of the LM head over all the rows' positions
    together, in chunks of positions, never a (T, V) float32 tensor at once."""
    from mtp_train.teacher import stats_from_hidden

    flat = torch.cat(hidden)  # (sum T_i, d)
    st = stats_from_hidden(flat, lm_head)
    h = flat.float().cpu().numpy().astype(NP_DTYPES[dtype])
    stats = torch.stack([st["lse"], st["entropy"]], -1).cpu().numpy()  # (sum T_i, 2)
    top = st["top"].cpu().numpy().astype(np.int32)
    cuts = np.cumsum([len(x) for x in hidden])[:-1]
    parts = [np.split(h, cuts), np.split(stats, cuts), np.split(top, cuts)]
    if aux is not None:
        parts.append(np.split(torch.cat(aux).float().cpu().numpy().astype(NP_DTYPES[dtype]), cuts))
    return list(zip(*parts, strict=True))


def right_pad(ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids -> input ids (B, T) right-padded with 0 and the attention mask (B, T)."""
    T = max(len(x) for x in ids)
    inp = torch.zeros((len(ids), T), dtype=torch.long)
    attn = torch.zeros((len(ids), T), dtype=torch.long)
    for i, x in enumerate(ids):
        inp[i, : len(x)] = torch.as_tensor(x)
        attn[i, : len(x)] = 1
    return inp, attn


def _hidden_rows(backbone, ids: list[list[int]], dtype: str, compute: str = "float32",
                 aux_layers: list[int] | None = None) -> list[RowStates]:
    """One right-padded batch -> each row's stored states, in the order given."""
    inp, attn = right_pad(ids)
    with autocast_to(backbone.device, compute):
        h, aux = backbone.hidden_and_aux(inp.to(backbone.device), attn.to(backbone.device), aux_layers)
        return batch_states([h[i, : len(x)] for i, x in enumerate(ids)], backbone.lm_head, dtype,
                            None if aux is None else [aux[i, : len(x)] for i, x in enumerate(ids)])
