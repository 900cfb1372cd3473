"""CLP acceptance labels, made by the framework itself (ALGORITHMS.md, "CLP").

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

from tqdm.auto import tqdm

from mtp_train.artifacts import (
    MANIFEST,
    config_hash,
    publish_dir,
    read_json,
    read_manifest,
    temp_dir_for,
    write_json_atomic,
)

log = logging.getLogger(__name__)
PLAN = "plan.json"


def make_labels(prompts: list[list[int]], decoder, out: Path, max_new_tokens: int, shard_prompts: int,
                identity: dict) -> dict:
    """Decode `prompts` with `decoder` (verify mode, recording) into a labels dataset at `out`.
    `identity` (backbone, heads hash, ...) keys the plan: changed inputs discard old shards."""
    from datasets import Dataset, concatenate_datasets, load_from_disk

    out = Path(out)
    k = decoder.k
    plan = {"identity": identity, "prompts": config_hash(prompts), "n_prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "shard_prompts": shard_prompts}
    key = config_hash(plan)
    if (m := read_manifest(out)) is not None and m.get("config_hash") == key:
        log.info("labels: %s is up to date", out)
        return m
    shards = out.with_name(out.name + ".shards")
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
            res = decoder.generate(prompts[j], max_new_tokens, "verify", record=True)
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
    tmp = temp_dir_for(out)
    ds.save_to_disk(str(tmp))
    write_json_atomic(tmp / MANIFEST, manifest)
    publish_dir(tmp, out)
    shutil.rmtree(shards, ignore_errors=True)
    log.info("labels: %d steps from %d prompts, histogram of m* %s", len(ds), len(prompts), hist)
    return manifest
