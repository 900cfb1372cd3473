"""Our hidden-state cache written as the training data of `speculators`' own EAGLE-3 trainer
(`python -m speculators.train`, read by its `ArrowDataset` + file transfer), so that trainer can learn
from exactly the rows and states ours does (bench/peer_side_by_side.py, docs/training.md, "The
peer's trainer").

What it reads, per row i of a `datasets` folder saved in the torch format:
- columns `input_ids` (int64 [L]) and `loss_mask` (int64 [L]); the rows are unshifted (its loader
  drops the first token and pairs the fused state at t with the token at t + 1);
- `hidden_states/hs_<i>.safetensors`: `hidden_states` [L, n_aux + 1, d], the auxiliary layers in its
  `--target-layer-ids` order then the last decoder layer's output *before* the final norm (its
  teacher is verifier_lm_head(verifier_norm(that))), and `token_ids` (= input_ids, checked);
- `d2t-<N>.npy` / `t2d-<N>.npy`: the draft vocabulary (here ours, so both drafters score the same
  tokens).

Two translations keep its targets and loss positions equal to ours:
- the cache stores the final state after the norm, h = w * u / rms(u). We write h / w, whose RMS is 1
  (up to the norm's epsilon), so verifier_norm(h / w) = w * (h / w) = h: the teacher it computes is
  the one our KL uses (checked by a test against the backbone's own logits).
- our loss counts the draft of x_{t+1+j} when that token is an answer token (depth_targets.py); its
  mask at i, after its shift, decides the prediction made from position i of token i + 1, so
  loss_mask[i] = (labels[i + 1] is an answer token).
Train rows come first, then validation rows: `--train-data-ratio` = `train_data_ratio` (returned)
splits them exactly where ours do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from mtp_train.depth_targets import IGNORE
from mtp_train.errors import DataError


def final_norm_weight(backbone) -> torch.Tensor:
    """The gain of the backbone's final RMSNorm (the decoder's `norm`)."""
    decoder = backbone.model.get_decoder() if hasattr(backbone.model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise DataError(f"{backbone.name}: no final norm found (model.get_decoder().norm); the speculators "
                        "format needs the last layer's output before it")
    return norm.weight.detach().float().cpu()


def loss_mask_from_labels(labels: np.ndarray) -> np.ndarray:
    """mask[i] = labels[i + 1] is an answer token (0 at the last position)."""
    labels = np.asarray(labels)
    mask = np.zeros(len(labels), np.int64)
    mask[:-1] = labels[1:] != IGNORE
    return mask


def write_speculators_data(cache, splits: dict, norm_weight: torch.Tensor, out: Path,
                           draft_ids: torch.Tensor | None = None, vocab_size: int | None = None) -> dict:
    """Write `splits` ({"train", "validation"} rows with input_ids and labels, in the cache's row order)
    with the cache's states into `out` (built in a temporary folder, then moved into place). Returns
    {"rows", "train_rows", "train_data_ratio", "tokens", "draft_vocab_size"}."""
    from datasets import Dataset
    from safetensors.torch import save_file

    from mtp_train.artifacts import publish_dir, temp_dir_for

    if not cache.aux_layers:
        raise DataError(f"{cache.path}: holds no auxiliary layer states; build it with `mtp-prep stage=cache "
                        "heads=eagle3` (EAGLE-3's fused layers are what the speculators trainer reads)")
    out = Path(out)
    tmp = temp_dir_for(out)
    (tmp / "hidden_states").mkdir(parents=True)
    ids_col, mask_col, lens = [], [], []
    inv = (1.0 / norm_weight.float()).numpy()
    n_aux = len(cache.aux_layers)
    row = 0
    for split in ("train", "validation"):
        rows = splits[split]
        if len(rows) != cache.manifest["rows"][split]:
            raise DataError(f"{cache.path}: the cache has {cache.manifest['rows'][split]} {split} rows, the data "
                            f"{len(rows)}; they were prepared from different data")
        for i in range(len(rows)):
            hidden = np.asarray(cache.row(split, i), np.float32)
            aux = np.asarray(cache.aux(split, i), np.float32)
            T = hidden.shape[0]  # rows longer than the cache's max_length are cropped there
            ids = np.asarray(rows[i]["input_ids"][:T], np.int64)
            labels = np.asarray(rows[i]["labels"][:T])
            pre = hidden * inv  # RMS 1: the verifier's norm maps it back onto the cached state
            states = np.concatenate([aux.reshape(T, n_aux, -1), pre[:, None, :]], 1)
            save_file({"hidden_states": torch.from_numpy(states).to(torch.float16).contiguous(),
                       "token_ids": torch.from_numpy(ids)}, str(tmp / "hidden_states" / f"hs_{row}.safetensors"))
            ids_col.append(ids)
            mask_col.append(loss_mask_from_labels(labels))
            lens.append(T)
            row += 1
    n_train = len(splits["train"])
    ds = Dataset.from_dict({"input_ids": ids_col, "loss_mask": mask_col, "seq_len": lens})
    ds.with_format("torch").save_to_disk(str(tmp))
    draft_size = None
    if draft_ids is not None:
        draft_ids = torch.as_tensor(draft_ids).long().cpu()
        draft_size = len(draft_ids)
        d2t = draft_ids - torch.arange(draft_size)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        np.save(tmp / f"d2t-{draft_size}.npy", d2t.numpy())
        np.save(tmp / f"t2d-{draft_size}.npy", t2d.numpy())
    # a ratio whose int(rows x ratio) is exactly the number of training rows
    summary = {"rows": row, "train_rows": n_train, "train_data_ratio": (n_train + 0.5) / row,
               "tokens": int(sum(lens)), "draft_vocab_size": draft_size, "aux_layers": list(cache.aux_layers)}
    (tmp / "mtp_train_source.json").write_text(json.dumps({**summary, "cache": str(cache.path)}, indent=1))
    publish_dir(tmp, out)
    return summary
