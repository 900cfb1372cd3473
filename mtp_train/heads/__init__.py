"""Draft heads: plain nn.Modules (no Lightning, no Hydra). `build_heads` picks one from the config,
`load_heads` rebuilds trained heads from `heads.safetensors` + `heads.json`.

Both families share one interface:
    forward(hidden (B, T, d), input_ids (B, T), embed, attention_mask) -> (B, T, k, d)
    project(head_hidden (B, T, k, d), lm_head) -> logits (B, T, k, |D|)
    to_tokens / to_draft   draft index <-> token id (identity without a draft vocabulary)
The backbone's embedding and LM head are passed in at call time, never stored, so a heads
state_dict holds only what trains (plus the draft vocabulary's token ids, when there is one).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from mtp_train.config import HeadsConfig
from mtp_train.errors import ConfigError, MtpError
from mtp_train.heads.chained import ChainedMTP
from mtp_train.heads.eagle3 import Eagle3Heads, default_aux_layers
from mtp_train.heads.medusa import MedusaHeads
from mtp_train.layout import HEADS_FILE, HEADS_META

__all__ = ["HEADS_FILE", "HEADS_META", "ChainedMTP", "Eagle3Heads", "MedusaHeads", "aux_layers_for",
           "build_heads", "count_parameters", "heads_state_dict", "load_heads"]


def aux_layers_for(cfg: HeadsConfig, backbone_config) -> list[int] | None:
    """The backbone layers whose inputs the heads read besides the final state (eagle3), else None."""
    if cfg.type != "eagle3":
        return None
    return list(cfg.aux_layers) if cfg.aux_layers is not None else default_aux_layers(
        backbone_config.num_hidden_layers)


def build_heads(cfg: HeadsConfig, backbone, draft_ids: torch.Tensor | None = None) -> nn.Module:
    if cfg.type == "medusa":
        copy = backbone.lm_head.weight.detach() if cfg.lm_head == "copy" else None
        return MedusaHeads(backbone.hidden_size, backbone.vocab_size, cfg.k, cfg.num_layers, copy,
                           draft_ids=draft_ids)
    if cfg.type == "eagle3":
        try:
            copy = backbone.lm_head.weight.detach() if cfg.lm_head == "copy" else None
            return Eagle3Heads(backbone.config, cfg.k, aux_layers_for(cfg, backbone.config), copy,
                               draft_ids=draft_ids, norm_before_residual=cfg.norm_before_residual)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    init_from = backbone.model.base_model if cfg.init == "copy_last" else None
    return ChainedMTP(backbone.config, cfg.k, init_from=init_from, draft_ids=draft_ids, share=cfg.share)


def count_parameters(module: nn.Module) -> dict:
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": sum(p.numel() for p in module.parameters())}


def heads_state_dict(heads: nn.Module) -> dict[str, torch.Tensor]:
    """What a heads file holds: the parameters that train, and the draft vocabulary's ids if any."""
    names = {n for n, p in heads.named_parameters() if p.requires_grad}
    if getattr(heads, "draft_ids", None) is not None:
        names.add("draft_ids")
    return {n: t.detach().contiguous() for n, t in heads.state_dict().items() if n in names}


def heads_config_from(meta: dict, meta_file: Path) -> HeadsConfig:
    """The heads' settings recorded in heads.json; faults are the file's, not the command line's."""
    import dataclasses

    recorded = meta.get("heads") if isinstance(meta, dict) else None
    if not isinstance(recorded, dict):
        raise MtpError(f"{meta_file}: has no 'heads' settings (written by mtp-train, or damaged)")
    known = {f.name for f in dataclasses.fields(HeadsConfig)}
    if stray := sorted(set(recorded) - known):
        raise MtpError(f"{meta_file}: 'heads' has keys this version does not know: {', '.join(stray)} "
                       f"(known: {', '.join(sorted(known))})")
    try:
        return HeadsConfig(**recorded)
    except (ConfigError, TypeError, ValueError) as e:
        raise MtpError(f"{meta_file}: its 'heads' settings are invalid ({e})") from None


def _check_same_backbone(meta_file: Path, recorded: dict, backbone, allow_foreign: bool) -> None:
    """Heads drafted for one backbone's hidden states are wrong for another of the same shape. The
    weights decide; the name (a free label) decides alone only for heads saved before fingerprints."""
    log = logging.getLogger("mtp_train")
    if recorded.get("fingerprint") is not None and recorded["fingerprint"] == backbone.fingerprint():
        if recorded.get("name") not in (None, backbone.name):
            log.warning("%s: heads were trained on these weights under the name %r (this backbone is "
                        "named %r)", meta_file, recorded["name"], backbone.name)
        return
    problems = []
    if recorded.get("name") not in (None, backbone.name):
        problems.append(f"named {recorded['name']!r}, this one is {backbone.name!r}")
    if recorded.get("fingerprint") not in (None, backbone.fingerprint()):  # heads from before fingerprints: name only
        problems.append(f"weights fingerprint {recorded['fingerprint']}, this one's is {backbone.fingerprint()}")
    if not problems:
        return
    what = f"{meta_file}: heads were trained on another backbone ({'; '.join(problems)})"
    if not allow_foreign:
        raise ConfigError(f"{what}; use the backbone they were trained on, or set "
                          "backbone.allow_foreign_heads=true to load them anyway")
    log.warning("%s; loading them anyway (backbone.allow_foreign_heads=true)", what)


def load_heads(path: str | Path, backbone, allow_foreign: bool = False) -> tuple[nn.Module, dict]:
    """Trained heads from a directory with heads.safetensors + heads.json, checked against `backbone`:
    its shape always; its name and weights fingerprint unless `allow_foreign`
    (backbone.allow_foreign_heads), which only warns. Heads trained with LoRA adapters bring them:
    the adapters are loaded into `backbone` (in place), which is then the adapted model.

    Returns (heads in eval mode on the backbone's device, the heads.json metadata)."""
    from mtp_train.artifacts import load_weights, read_weights_meta

    d = Path(path)
    meta, meta_file, weights = read_weights_meta(d, HEADS_META, HEADS_FILE, "written by mtp-train")
    bb = meta.get("backbone") if isinstance(meta, dict) else None
    if not isinstance(bb, dict):
        raise MtpError(f"{meta_file}: has no 'backbone' record (written by mtp-train, or damaged)")
    for key, have in (("hidden_size", backbone.hidden_size), ("vocab_size", backbone.vocab_size)):
        if bb.get(key) != have:
            raise ConfigError(f"{meta_file}: heads were trained for a backbone with {key}={bb.get(key)}, "
                              f"this backbone ({backbone.name}) has {have}")
    _check_same_backbone(meta_file, bb, backbone, allow_foreign)
    state = load_weights(weights)
    cfg = heads_config_from(meta, meta_file)
    heads = build_heads(cfg, backbone, draft_ids=state.get("draft_ids"))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    trainable = {n for n, p in heads.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise MtpError(f"{weights}: does not match {cfg.type} heads with k={cfg.k} "
                       f"(missing {sorted(trainable & set(missing))[:3]}, unexpected {unexpected[:3]})")
    if meta.get("adapter"):  # trained jointly with LoRA adapters: the heads draft for the adapted backbone
        from mtp_train.adapters import attach_run_adapter

        attach_run_adapter(d, meta["adapter"], backbone)
    return heads.to(backbone.device).eval(), meta
