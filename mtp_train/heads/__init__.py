"""Draft heads: plain nn.Modules (no Lightning, no Hydra). `build_heads` picks one from the config.

Both families share one interface:
    forward(hidden (B, T, d), input_ids (B, T), embed, attention_mask) -> (B, T, k, d)
    project(head_hidden (B, T, k, d), lm_head) -> logits (B, T, k, V)
The backbone's embedding and LM head are passed in at call time, never stored, so a heads
state_dict holds only what trains.
"""

from __future__ import annotations

from torch import nn

from mtp_train.config import HeadsConfig
from mtp_train.heads.chained import ChainedMTP
from mtp_train.heads.medusa import MedusaHeads

__all__ = ["ChainedMTP", "MedusaHeads", "build_heads", "count_parameters"]


def build_heads(cfg: HeadsConfig, backbone) -> nn.Module:
    if cfg.type == "medusa":
        copy = backbone.lm_head.weight.detach() if cfg.lm_head == "copy" else None
        return MedusaHeads(backbone.hidden_size, backbone.vocab_size, cfg.k, cfg.num_layers, copy)
    return ChainedMTP(backbone.config, cfg.k, init_from=backbone.model.base_model)


def count_parameters(module: nn.Module) -> dict:
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": sum(p.numel() for p in module.parameters())}
