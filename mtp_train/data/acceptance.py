"""CLP acceptance labels, made by the framework itself (docs/algorithms.md, "CLP").

Prompts are decoded greedily with the backbone and the trained heads in verify mode, so the output is
the backbone's own text; at every step that drafted all k heads the row records the backbone's final
hidden state h_p, the heads' top-1 probabilities and the label m* = how many leading drafts equal the
backbone's greedy tokens (the verify step's kept count). Prompts are cut into shards written
atomically under `<out>.shards/`; a rerun skips finished shards. The output is an HF dataset on disk
(columns hidden, head_probs, label, prompt) with a manifest: backbone, heads checkpoint hash, prompts,
label histogram.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mtp_train.artifacts import (
    config_hash,
    publish_dir,
    read_json,
    read_manifest,
    temp_dir_for,
    write_json_atomic,
)
from mtp_train.errors import MtpError
from mtp_train.layout import MANIFEST, PLAN, shards_dir

log = logging.getLogger(__name__)


def publish_labels(ds, manifest: dict, out: Path) -> None:
    """The labels dataset and its manifest, written under a temporary name and moved into place."""
    tmp = temp_dir_for(out)
    ds.save_to_disk(str(tmp))
    write_json_atomic(tmp / MANIFEST, manifest)
    publish_dir(tmp, out)


def make_labels(prompts: list[list[int]], decoder, out: Path, max_new_tokens: int, shard_prompts: int,
                identity: dict, chain) -> dict:
    """Decode `prompts` with `decoder`, verifying a chain of all k drafts per step (`chain`, the
    decoder's plan source for it, decoding.plans.Chain) and recording, into a labels dataset at
    `out`. `identity` (backbone, heads hash, ...) keys the plan: changed inputs discard old shards."""
    from datasets import Dataset, concatenate_datasets, load_from_disk

    out = Path(out)
    k = decoder.k
    plan = {"identity": identity, "prompts": config_hash(prompts), "n_prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "shard_prompts": shard_prompts}
    key = config_hash(plan)
    if (m := read_manifest(out)) is not None and m.get("config_hash") == key:
        log.info("labels: %s is up to date", out)
        return m
    shards = shards_dir(out)
    if (read_json(shards / PLAN) or {}).get("config_hash") != key:
        shutil.rmtree(shards, ignore_errors=True)
    shards.mkdir(parents=True, exist_ok=True)
    write_json_atomic(shards / PLAN, {"config_hash": key})
    starts = list(range(0, len(prompts), shard_prompts))
    bar = tqdm(total=len(prompts), desc="acceptance labels", unit="prompt", dynamic_ncols=True)
    for i, s in enumerate(starts):
        final = shards / f"{i:05d}"
        if final.is_dir():
            bar.update(min(shard_prompts, len(prompts) - s))
            continue
        cols = {"hidden": [], "head_probs": [], "label": [], "prompt": []}
        for j in range(s, min(s + shard_prompts, len(prompts))):
            res = decoder.generate(prompts[j], max_new_tokens, chain, record=True)
            for h, p, kept in res.records:
                cols["hidden"].append(h.float().tolist())
                cols["head_probs"].append(p.float().tolist())
                cols["label"].append(kept)
                cols["prompt"].append(j)
            bar.update(1)
        tmp = temp_dir_for(final)
        Dataset.from_dict(cols).save_to_disk(str(tmp))
        publish_dir(tmp, final)
    bar.close()
    parts = [load_from_disk(str(shards / f"{i:05d}")) for i in range(len(starts))]
    ds = concatenate_datasets([p for p in parts if len(p)]) if any(len(p) for p in parts) else parts[0]
    hist = [0] * (k + 1)
    for label in ds["label"]:
        hist[label] += 1
    manifest = {"stage": "clp-label", "config_hash": key, **identity, "n_prompts": len(prompts),
                "rows": len(ds), "label_histogram": hist, "k": k}
    publish_labels(ds, manifest, out)
    shutil.rmtree(shards, ignore_errors=True)
    log.info("labels: %d steps from %d prompts, histogram of m* %s", len(ds), len(prompts), hist)
    return manifest


def greedy_path_labels(drafts: torch.Tensor, ids: torch.Tensor, greedy: torch.Tensor,
                       answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """m* at every position of one row whose text is the backbone's own greedy output.

    drafts (T, k): the heads' top-1 token per depth at each position, teacher-forced on the row;
    ids (T,): the row; greedy (T,): the backbone's argmax at each position (the cache's `top`);
    answer (T,) bool: positions whose token the backbone generated (the self-distilled answer).

    A decoding step at position p commits the backbone's token g_p as x_{p+1}, and draft j (made
    from h_p and x_{p+1..p+j}) is kept when it equals g_{p+j}. On a row where x_{p+1..p+j} are the
    backbone's greedy tokens, the teacher-forced drafts are exactly the drafts decoding would make,
    so m* = the number of leading j with drafts[p, j] == greedy[p + j]. Returns (positions (N,),
    labels (N,)): positions whose tokens p+1..p+k+1 all lie in the answer and where x_{p+1} = g_p;
    a position whose text leaves the greedy path before the first miss is dropped (its m* is unknown).
    """
    T, k = drafts.shape
    n = T - k - 1  # positions p with tokens up to p + k + 1 inside the row
    if n <= 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    p = torch.arange(n)
    on_path = ids[p[:, None] + torch.arange(1, k + 2)] == greedy[p[:, None] + torch.arange(0, k + 1)]  # (n, k+1)
    inside = answer[p[:, None] + torch.arange(1, k + 2)].all(-1)  # (n,)
    hit = drafts[:n] == greedy[p[:, None] + torch.arange(1, k + 1)]  # (n, k): draft j vs g_{p+j}
    lead = hit.long().cumprod(-1)  # 1 while every draft so far is kept
    label = lead.sum(-1)  # (n,)
    # draft j's inputs x_{p+1..p+j} must be greedy for it to be decoding's draft: every depth up to
    # the first miss (label + 1 drafts, at most k) needs x_{p+1..p+label+1} on the path
    need = torch.clamp(label + 1, max=k)
    known = on_path.long().cumprod(-1).sum(-1) >= need
    keep = inside & on_path[:, 0] & known
    return p[keep], label[keep]


@torch.no_grad()
def labels_from_cache(rows, cache, split: str, first: int, heads, backbone, out: Path,
                      identity: dict) -> dict:
    """Acceptance labels from the hidden-state cache: the self-distilled rows `first..` of `split`
    (the backbone's own greedy answers) are drafted teacher-forced by `heads` (no backbone forward),
    and every answer position on the greedy path gives one label (`greedy_path_labels`). Far more
    labels than decoding prompts gives, in seconds instead of minutes; same dataset layout."""
    import numpy as np
    from datasets import Dataset

    from mtp_train.depth_targets import IGNORE

    out = Path(out)
    key = config_hash({"identity": identity, "source": "cache", "rows": len(rows) - first})
    if (m := read_manifest(out)) is not None and m.get("config_hash") == key:
        log.info("labels: %s is up to date", out)
        return m
    import types

    k, embed = heads.k, backbone.embed_tokens
    dtype = next(heads.parameters()).dtype
    lm_head = types.SimpleNamespace(weight=backbone.lm_head.weight.to(dtype))  # the heads' dtype, whatever the backbone's
    with_aux = bool(heads.aux_layers)  # heads that read backbone layers besides the final state
    cols = {"hidden": [], "head_probs": [], "label": [], "prompt": []}
    for i in tqdm(range(first, len(rows)), desc="acceptance labels (cache)", unit="row", dynamic_ncols=True):
        ids = torch.as_tensor(rows[i]["input_ids"], dtype=torch.long)
        answer = torch.as_tensor(rows[i]["labels"]) != IGNORE  # labels[t] = ids[t] on answer tokens
        hidden = torch.from_numpy(np.asarray(cache.row(split, i), dtype=np.float32))  # (T, d), cropped
        greedy = torch.from_numpy(np.asarray(cache.stats(split, i)["top"]).astype(np.int64))  # (T,)
        T = len(hidden)
        ids, answer, hidden, greedy = ids[:T], answer[:T], hidden[:T], greedy[:T]
        aux = torch.from_numpy(np.asarray(cache.aux(split, i)[:T], dtype=np.float32))[None] if with_aux else None
        head_hidden = heads(hidden[None].to(dtype), ids[None], embed, aux=aux)[0]  # (T, k, d)
        prob, idx = torch.softmax(heads.project(head_hidden, lm_head).float(), -1).max(-1)  # (T, k)
        pos, label = greedy_path_labels(heads.to_tokens(idx), ids, greedy, answer)
        cols["hidden"].append(hidden[pos].numpy())
        cols["head_probs"].append(prob[pos].numpy())
        cols["label"].append(label.numpy())
        cols["prompt"].append(np.full(len(pos), i - first))
    ds = Dataset.from_dict({n: np.concatenate(v) if v else np.zeros(0) for n, v in cols.items()})
    hist = np.bincount(ds["label"][:], minlength=k + 1).tolist() if len(ds) else [0] * (k + 1)
    manifest = {"stage": "clp-label", "config_hash": key, **identity, "source": "cache",
                "n_prompts": len(rows) - first, "rows": len(ds), "label_histogram": hist, "k": k}
    publish_labels(ds, manifest, out)
    log.info("labels: %d positions of %d self-distilled rows (from the cache), histogram of m* %s",
             len(ds), len(rows) - first, hist)
    return manifest


def read_labels(out: Path, k: int, hidden_size: int) -> tuple[torch.Tensor, ...]:
    """The labels dataset as tensors (hidden (n, d), head_probs (n, k), label (n,), prompt (n,)),
    checked row by row: damaged files are refused naming the first bad row, never fitted on."""
    from datasets import load_from_disk

    out = Path(out)
    redo = "rerun `mtp-clp stage=label force=true`"
    try:
        ds = load_from_disk(str(out)).with_format("numpy")  # columns as arrays, not Python lists
        cols = {c: torch.as_tensor(ds[c][:]) for c in ("hidden", "head_probs", "label", "prompt")}
    except Exception as e:  # Arrow reports damage as several error types
        raise MtpError(f"{out}: cannot read the acceptance labels ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}); {redo}") from None
    hidden, probs = cols["hidden"].float(), cols["head_probs"].float()
    labels, prompt = cols["label"].long(), cols["prompt"].long()
    n = len(labels)
    if n == 0:
        raise MtpError(f"{out}: no acceptance labels in it; {redo}")
    if hidden.shape != (n, hidden_size) or probs.shape != (n, k):
        raise MtpError(f"{out}: hidden {tuple(hidden.shape)} and head_probs {tuple(probs.shape)} do not fit "
                       f"d={hidden_size}, k={k}; {redo}")
    bad = {"a non-finite hidden state": ~torch.isfinite(hidden).all(-1),
           "a head probability outside [0, 1]": ~((probs >= 0) & (probs <= 1)).all(-1),
           f"a label outside 0..{k}": (labels < 0) | (labels > k),
           "a negative prompt index": prompt < 0}
    for what, rows in bad.items():
        if rows.any():
            raise MtpError(f"{out}: row {int(rows.nonzero()[0, 0])} has {what} ({int(rows.sum())} such rows); "
                           f"{redo}")
    return hidden, probs, labels, prompt
