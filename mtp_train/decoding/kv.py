"""KV-cache surgery on transformers caches: crop to a length, keep a subset of rows."""

from __future__ import annotations

import torch


def crop_to(cache, length: int) -> None:
    """Drop every row past `length`."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def keep_rows(cache, idx: torch.Tensor) -> None:
    """Keep only the sequence rows `idx` of every layer's keys and values."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
