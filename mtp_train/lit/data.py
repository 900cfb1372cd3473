"""DataModule over the datasets `mtp-prep` wrote (labelled and/or self-distilled Arrow data)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mtp_train.config_rules import check_k_fits
from mtp_train.data.prepared import load_splits
from mtp_train.depth_targets import IGNORE
from mtp_train.errors import DataError


def first_fraction(sizes: list[int], fraction: float) -> list[int]:
    """Row indices of the first `fraction` of each of the concatenated parts (at least one each):
    with train.data_use=mix a fraction takes original and distilled rows alike."""
    out, start = [], 0
    for n in sizes:
        out += range(start, start + (max(1, round(fraction * n)) if n else 0))
        start += n
    return out


class Collator:
    """Right-pads a list of rows to the longest (cropped to max_length)."""

    def __init__(self, pad_id: int, max_length: int):
        self.pad_id, self.max_length = pad_id, max_length

    def __call__(self, rows: list[dict]) -> dict:
        T = min(self.max_length, max(len(r["input_ids"]) for r in rows))
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
        attn = torch.zeros((len(rows), T), dtype=torch.long)
        cached = "hidden" in rows[0]
        if cached:
            hidden = torch.zeros((len(rows), T, rows[0]["hidden"].shape[-1]))  # (B, T, d)
            stats = {"lse": torch.zeros((len(rows), T)), "entropy": torch.zeros((len(rows), T)),
                     "top": torch.zeros((len(rows), T), dtype=torch.long)}  # (B, T) each
            aux = torch.zeros((len(rows), T, rows[0]["aux"].shape[-1])) if "aux" in rows[0] else None
        for i, r in enumerate(rows):
            n = min(T, len(r["input_ids"]))
            ids[i, :n] = torch.as_tensor(r["input_ids"][:n])
            labels[i, :n] = torch.as_tensor(r["labels"][:n])
            attn[i, :n] = 1
            if cached:
                hidden[i, :n] = torch.from_numpy(np.asarray(r["hidden"][:n], dtype=np.float32))
                if aux is not None:
                    aux[i, :n] = torch.from_numpy(np.asarray(r["aux"][:n], dtype=np.float32))
                for name, t in stats.items():
                    t[i, :n] = torch.from_numpy(np.asarray(r[name][:n]).astype(np.int64 if name == "top"
                                                                               else np.float32))
        batch = {"input_ids": ids, "labels": labels, "attention_mask": attn}
        if cached:
            batch.update(hidden=hidden, **stats)
            if aux is not None:
                batch["aux"] = aux  # (B, T, n_aux * d)
        return batch


class CachedRows(Dataset):
    """Rows of a prepared split with their cached hidden states attached."""

    def __init__(self, rows, cache, split: str):
        if len(rows) != cache.manifest["rows"][split]:
            raise DataError(f"{cache.path}: cache has {cache.manifest['rows'][split]} {split} rows, "
                            f"the data has {len(rows)}; rebuild it with `mtp-prep stage=cache`")
        import pyarrow.compute as pc

        # every row's states cover its tokens up to the cache's row length (lengths read from arrow)
        n_tokens = pc.list_value_length(rows.with_format("arrow")["input_ids"]).to_numpy()
        want = np.minimum(n_tokens, cache.manifest.get("max_length") or 10**9)
        have = cache.lengths(split)
        if (bad := np.flatnonzero(want != have)).size:
            i = int(bad[0])
            raise DataError(f"{cache.path}: {split} row {i} has states for {int(have[i])} tokens, the data's "
                            f"row has {int(want[i])} ({bad.size} row(s) differ); the cache was built from "
                            "other data or is damaged: delete it and run `mtp-prep stage=cache` again")
        self.rows, self.cache, self.split = rows, cache, split
        self.with_aux = cache.aux_layers is not None  # built for heads that read auxiliary layers

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = {**self.rows[i], "hidden": self.cache.row(self.split, i), **self.cache.stats(self.split, i)}
        if self.with_aux:
            row["aux"] = self.cache.aux(self.split, i)
        return row


class ResumableSampler(Sampler):
    """A seeded permutation per epoch, split by rank, that can skip rows a resumed run has seen.

    Every rank draws the same permutation and takes every world-th row of it (rank r: r, r+w, ...),
    after dropping the tail that would leave ranks with unequal batch counts (a rank waiting for a
    gradient all-reduce the others never start would hang). So global batch s of a w-process run
    holds exactly the rows of batch s of a one-process run with w times the batch size.
    Lightning calls `set_epoch`; the LightningModule sets `skip` (rows of this rank) when it resumes
    mid-epoch, so a resumed run sees exactly the batches an uninterrupted one would have.

    With `lengths` and `window` > 1, batches hold rows of similar length (less right-padding, the
    same rows per step): the permutation is cut into windows of `window` global batches (`batch` x
    world rows each), each window is sorted by length, cut into global batches, and those batches are
    shuffled. Batch boundaries are those of the ungrouped sampler, and so is the correspondence above,
    except in the last window when n is not a multiple of world (the rows left out are sorted in).
    """

    def __init__(self, n: int, seed: int, rank: int = 0, world: int = 1,
                 lengths: Sequence[int] | None = None, batch: int = 1, window: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"{len(lengths)} lengths for {n} rows")
        self.n, self.seed, self.rank, self.world = n, seed, rank, world
        self.lengths, self.batch, self.window = lengths, batch, window
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g)[: len(self) * self.world].tolist()
        if self.lengths is not None and self.window > 1:
            order = self._grouped(order, g)
        mine = order[self.rank::self.world]
        skip, self.skip = self.skip, 0
        return iter(mine[skip:])

    def _grouped(self, order: list[int], g: torch.Generator) -> list[int]:
        step = self.batch * self.world  # rows of one global batch
        out = []
        for w in range(0, len(order), step * self.window):
            rows = sorted(order[w: w + step * self.window], key=lambda i: -self.lengths[i])
            full = len(rows) // step * step  # a partial global batch can only be the epoch's last: it stays last
            for b in torch.randperm(full // step, generator=g).tolist():
                out += rows[b * step: (b + 1) * step]
            out += rows[full:]
        return out


class RankSlice(Sampler):
    """Validation rows of one rank: r, r+w, r+2w, ..., the same count on every rank (the last
    n mod w rows are left out when w > 1): ZeRO-3 gathers parameters in every forward, so ranks
    must run as many batches as each other. No row is seen twice, so val/sim_tau, reduced as sums
    and counts over ranks, is exact over the rows used."""

    def __init__(self, n: int, rank: int = 0, world: int = 1):
        self.n, self.rank, self.world = n - n % world, rank, world

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))

    def __iter__(self):
        return iter(range(self.rank, self.n, self.world))


class MTPDataModule(L.LightningDataModule):
    def __init__(self, dirs: list[Path], pad_id: int, batch_size: int, max_length: int,
                 num_workers: int = 0, seed: int = 0, cache=None, data_fraction: float = 1.0,
                 k: int | None = None, length_window: int = 0, vocab_size: int | None = None):
        super().__init__()
        self.vocab_size = vocab_size  # token ids of the rows are checked against it (load_splits)
        self.length_window = length_window  # batches per length-sorted window (ResumableSampler); 0: off
        self.k = k  # the heads' depth: each split needs a row long enough for one target at every depth
        self.cache = cache  # a HiddenCache: batches then carry "hidden" and the backbone is skipped
        self.dirs, self.batch_size, self.num_workers, self.seed = dirs, batch_size, num_workers, seed
        self.collate = Collator(pad_id, max_length)
        self.max_length, self.data_fraction = max_length, data_fraction
        self.splits = None
        self.train_tokens = None  # tokens of the training rows in use, as cropped (set by setup)
        self.train_lengths = None  # their lengths, as cropped, in the order of the training split in use

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            sizes = []
            splits = load_splits(self.dirs, sizes, self.vocab_size)
            if len(splits["train"]) == 0:
                raise DataError(f"no training rows in {', '.join(map(str, self.dirs))}")
            keep = first_fraction([s["train"] for s in sizes], self.data_fraction)
            ids = splits["train"]["input_ids"]
            self.train_lengths = [min(len(ids[i]), self.max_length) for i in keep]
            self.train_tokens = sum(self.train_lengths)
            if self.k is not None:
                for split, rows in (("training", [ids[i] for i in keep]),
                                    ("validation", splits["validation"]["input_ids"])):
                    longest = max((min(len(r), self.max_length) for r in rows), default=0)
                    check_k_fits(self.k, longest,
                                 f"the longest {split} row has {longest} (rows cropped to {self.max_length})")
            for split, rows, idx in (("training", splits["train"], keep),
                                     ("validation", splits["validation"], range(len(splits["validation"])))):
                # row by row, stopping at the first answer token (not the whole labels column)
                if not any(any(v != IGNORE for v in rows[i]["labels"][: self.max_length]) for i in idx):
                    if any(any(v != IGNORE for v in rows[i]["labels"]) for i in idx):
                        raise DataError(f"train.max_length={self.max_length}: crops every answer token off the "
                                        f"{split} rows (their prompts are longer); raise train.max_length")
                    raise DataError(f"{', '.join(map(str, self.dirs))}: the {split} rows hold no answer token "
                                    "to learn from (prompt-only rows?); add assistant turns, or train on "
                                    "self-distilled answers (train.data_use=distilled)")
            if self.cache is not None:
                splits = {s: CachedRows(d, self.cache, s) for s, d in splits.items()}
            if len(keep) < len(splits["train"]):  # by index: the cache is indexed by the full split
                splits["train"] = torch.utils.data.Subset(splits["train"], keep)
            self.splits = splits

    def _rank_world(self) -> tuple[int, int]:
        """This process's place among the data-parallel ranks (0 of 1 outside a Trainer)."""
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def train_dataloader(self):
        rank, world = self._rank_world()
        n = len(self.splits["train"])
        if n < world:
            raise DataError(f"{n} training rows cannot give each of {world} processes one; "
                            "lower trainer.devices")
        self.sampler = ResumableSampler(n, self.seed, rank, world, lengths=self.train_lengths,
                                        batch=self.batch_size, window=self.length_window)
        return DataLoader(self.splits["train"], batch_size=self.batch_size, sampler=self.sampler,
                          collate_fn=self.collate, num_workers=self.num_workers)

    def val_dataloader(self):
        rank, world = self._rank_world()
        if len(self.splits["validation"]) < world:
            raise DataError(f"{len(self.splits['validation'])} validation rows cannot give each of "
                            f"{world} processes one; lower trainer.devices")
        return DataLoader(self.splits["validation"], batch_size=self.batch_size,
                          sampler=RankSlice(len(self.splits["validation"]), rank, world),
                          collate_fn=self.collate, num_workers=self.num_workers)
