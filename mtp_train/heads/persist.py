"""Heads on disk: build heads from `heads.*`, save what trains, load trained heads back.

A run's heads are `heads.safetensors` (the trainable tensors and the draft vocabulary's ids) and
`heads.json` (the heads' settings, the backbone they were trained on, the recipe and metrics).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from mtp_train.config import HeadsConfig
from mtp_train.errors import ConfigError, MtpError
from mtp_train.heads.base import DraftHeads
from mtp_train.heads.registry import family
from mtp_train.layout import HEADS_FILE, HEADS_META


def aux_layers_for(cfg: HeadsConfig, backbone_config) -> list[int]:
    """The backbone layers whose inputs heads built from `cfg` read besides the final state (empty
    for the families that read only the final state)."""
    return family(cfg.type).heads_class().aux_layers_for(cfg, backbone_config)


def build_heads(cfg: HeadsConfig, backbone, draft_ids: torch.Tensor | None = None) -> DraftHeads:
    """Untrained heads of family `cfg.type` for `backbone`."""
    return family(cfg.type).heads_class().from_config(cfg, backbone, draft_ids)


def count_parameters(module: nn.Module) -> dict:
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": sum(p.numel() for p in module.parameters())}


def heads_state_dict(heads: nn.Module) -> dict[str, torch.Tensor]:
    """What a heads file holds: the parameters that train, and the draft vocabulary's ids if any."""
    names = {n for n, p in heads.named_parameters() if p.requires_grad}
    if heads.draft_ids is not None:
        names.add("draft_ids")
    return {n: t.detach().contiguous() for n, t in heads.state_dict().items() if n in names}


def _of_type(value, annotation: str) -> bool:
    """Whether a JSON value fits a HeadsConfig field's annotation ("int", "int | None", "list[int] | None",
    "str", "bool"); booleans are not ints here."""
    for alt in (a.strip() for a in annotation.split("|")):
        if alt == "None" and value is None:
            return True
        if alt == "bool" and isinstance(value, bool):
            return True
        if alt == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if alt == "str" and isinstance(value, str):
            return True
        if alt == "list[int]" and isinstance(value, list) and all(_of_type(v, "int") for v in value):
            return True
    return False


def heads_config_from(meta: dict, meta_file: Path) -> HeadsConfig:
    """The heads' settings recorded in heads.json; faults are the file's, not the command line's."""
    import dataclasses

    recorded = meta.get("heads") if isinstance(meta, dict) else None
    if not isinstance(recorded, dict):
        raise MtpError(f"{meta_file}: has no 'heads' settings (written by mtp-train, or damaged)")
    known = {f.name: f.type for f in dataclasses.fields(HeadsConfig)}
    if stray := sorted(set(recorded) - set(known)):
        raise MtpError(f"{meta_file}: 'heads' has keys this version does not know: {', '.join(stray)} "
                       f"(known: {', '.join(sorted(known))})")
    for key, value in recorded.items():  # the dataclass takes any value: a "3" for k would fail later
        if not _of_type(value, known[key]):
            raise MtpError(f"{meta_file}: heads.{key} is {value!r}; expected {known[key]}")
    try:
        cfg = HeadsConfig(**recorded)
    except (ConfigError, TypeError, ValueError) as e:
        raise MtpError(f"{meta_file}: its 'heads' settings are invalid ({e})") from None
    check_heads_summary(meta, cfg, meta_file)
    return cfg


def check_heads_summary(meta: dict, cfg: HeadsConfig, meta_file: Path) -> None:
    """heads.json states the family and k twice, at the top (what reports read) and in its 'heads'
    settings (what loading builds): refuse a file where they differ (an edit), naming both."""
    for top, nested in (("head_type", cfg.type), ("k", cfg.k)):
        if top in meta and meta[top] != nested:
            key = "type" if top == "head_type" else top
            raise MtpError(f"{meta_file}: {top} is {meta[top]!r} but heads.{key} is {nested!r}; the file was "
                           "edited or damaged (mtp-train writes both the same)")


def _check_same_backbone(meta_file: Path, recorded: dict, backbone, allow_foreign: bool) -> None:
    """Heads drafted for one backbone's hidden states are wrong for another of the same shape: the
    weights' fingerprint decides; the name, a free label, only adds to the message."""
    log = logging.getLogger("mtp_train")
    if not isinstance(recorded.get("fingerprint"), str):
        raise MtpError(f"{meta_file}: its 'backbone' record has no weights fingerprint (written by "
                       "mtp-train, or damaged)")
    if recorded["fingerprint"] == backbone.fingerprint():
        if recorded.get("name") not in (None, backbone.name):
            log.warning("%s: heads were trained on these weights under the name %r (this backbone is "
                        "named %r)", meta_file, recorded["name"], backbone.name)
        return
    problems = []
    if recorded.get("name") not in (None, backbone.name):
        problems.append(f"named {recorded['name']!r}, this one is {backbone.name!r}")
    if recorded["fingerprint"] != backbone.fingerprint():
        problems.append(f"weights fingerprint {recorded['fingerprint']}, this one's is {backbone.fingerprint()}")
    if not problems:
        return
    what = f"{meta_file}: heads were trained on another backbone ({'; '.join(problems)})"
    if not allow_foreign:
        raise ConfigError(f"{what}; use the backbone they were trained on, or set "
                          "backbone.allow_foreign_heads=true to load them anyway")
    log.warning("%s; loading them anyway (backbone.allow_foreign_heads=true)", what)


def check_weights_digest(meta: dict, weights: Path) -> None:
    """heads.safetensors as training wrote it: the sha256 heads.json records (runs from before it was
    recorded have none, and are read as they are)."""
    from mtp_train.artifacts import file_sha256

    want = meta.get("weights_sha256")
    if want is not None and file_sha256(weights) != want:
        raise MtpError(f"{weights}: its contents changed after training wrote it (the sha256 recorded in "
                       "heads.json differs): damaged or edited; train again (force=true) or restore the file")


def load_checked(heads: nn.Module, state: dict, weights: Path, cfg: HeadsConfig) -> None:
    """Load `state` into `heads`, refusing tensors of another shape or kind, tensors the heads do not
    have, and trainable ones the file lacks (frozen ones, such as a shared LM head, are rebuilt)."""
    from mtp_train.artifacts import check_state_matches

    check_state_matches(state, heads.state_dict(), str(weights))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    trainable = {n for n, p in heads.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise MtpError(f"{weights}: does not match {cfg.type} heads with k={cfg.k} "
                       f"(missing {sorted(trainable & set(missing))[:3]}, unexpected {unexpected[:3]})")


def load_heads(path: str | Path, backbone, allow_foreign: bool = False) -> tuple[nn.Module, dict]:
    """Trained heads from a directory with heads.safetensors + heads.json, checked against `backbone`:
    its shape always; its name and weights fingerprint unless `allow_foreign`
    (backbone.allow_foreign_heads), which only warns. Heads trained with LoRA adapters bring them:
    the adapters are loaded into `backbone` (in place), which is then the adapted model.

    Returns (heads in eval mode on the backbone's device, the heads.json metadata)."""
    from mtp_train.artifacts import load_weights, read_weights_meta
    from mtp_train.heads.vocab import check_draft_ids

    d = Path(path)
    meta, meta_file, weights = read_weights_meta(d, HEADS_META, HEADS_FILE, "written by mtp-train")
    bb = meta.get("backbone") if isinstance(meta, dict) else None
    if not isinstance(bb, dict):
        raise MtpError(f"{meta_file}: has no 'backbone' record (written by mtp-train, or damaged)")
    for key, have in (("hidden_size", backbone.hidden_size), ("vocab_size", backbone.vocab_size)):
        if not _of_type(bb.get(key), "int"):
            raise MtpError(f"{meta_file}: backbone.{key} is {bb.get(key)!r}; expected int (edited or damaged)")
        if bb.get(key) != have:
            raise ConfigError(f"{meta_file}: heads were trained for a backbone with {key}={bb.get(key)}, "
                              f"this backbone ({backbone.name}) has {have}")
    _check_same_backbone(meta_file, bb, backbone, allow_foreign)
    state = load_weights(weights)  # unreadable or non-finite: named as such first
    check_weights_digest(meta, weights)
    cfg = heads_config_from(meta, meta_file)
    if "draft_ids" in state:
        check_draft_ids(state["draft_ids"], backbone.vocab_size, str(weights))
    heads = build_heads(cfg, backbone, draft_ids=state.get("draft_ids"))
    if meta.get("draft_size") not in (None, heads.draft_size):
        raise MtpError(f"{meta_file}: draft_size is {meta['draft_size']!r}, the heads' draft vocabulary holds "
                       f"{heads.draft_size}; the file was edited or damaged")
    load_checked(heads, state, weights, cfg)
    if meta.get("adapter"):  # trained jointly with LoRA adapters: the heads draft for the adapted backbone
        from mtp_train.adapters import attach_run_adapter

        attach_run_adapter(d, meta["adapter"], backbone)
    return heads.to(backbone.device).eval(), meta


def read_speculators_eagle3(src: Path, heads_cfg, backbone) -> tuple[dict, torch.Tensor | None]:
    """An EAGLE-3 drafter in the speculators layout (what `speculators.train` saves, and what
    mtp-export-heads --format eagle3 writes) as (our Eagle3Heads' state, its draft ids or None), for `heads.from_speculators`.
    Everything our heads cannot express, or that differs from `heads_cfg` and this backbone, is refused
    in one line naming the key; the file's d2t sets the draft vocabulary."""
    from mtp_train.artifacts import load_weights, read_weights_meta
    from mtp_train.heads.eagle3 import Eagle3Heads

    config, cfg_file, weights = read_weights_meta(Path(src), "config.json", "model.safetensors",
                                                  "an EAGLE-3 drafter as speculators saves it")
    if not isinstance(config, dict) or config.get("speculators_model_type") != "eagle3":
        got = config.get("speculators_model_type") if isinstance(config, dict) else type(config).__name__
        raise MtpError(f"{cfg_file}: speculators_model_type is {got!r}; heads.from_speculators reads "
                       "EAGLE-3 drafters (\"eagle3\")")
    for key in ("norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad"):
        if config.get(key):
            flag = "--no-" + key.replace("_", "-") if key != "fc_norm" else "no --fc-norm"
            raise MtpError(f"{cfg_file}: {key} is true; mtp-train's EAGLE-3 heads (and the engines' drafter) "
                           f"have no such option: train the drafter with {flag} (speculators.train)")
    layer = config.get("transformer_layer_config") or {}
    if layer.get("num_hidden_layers", 1) != 1:
        raise MtpError(f"{cfg_file}: transformer_layer_config.num_hidden_layers is "
                       f"{layer.get('num_hidden_layers')!r}; mtp-train's EAGLE-3 heads have one draft layer")
    if layer.get("hidden_size") != backbone.hidden_size:
        raise ConfigError(f"{cfg_file}: a drafter of hidden size {layer.get('hidden_size')!r}, the backbone "
                          f"({backbone.name}) has {backbone.hidden_size}")
    want_aux = Eagle3Heads.aux_layers_for(heads_cfg, backbone.config)
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and sorted(int(i) for i in aux) != want_aux:
        raise ConfigError(f"heads.aux_layers: the drafter in {cfg_file} fuses layers {aux}, these heads "
                          f"{want_aux}; set heads.aux_layers={sorted(int(i) for i in aux)}")
    nbr = bool(config.get("norm_before_residual", False))
    if nbr != bool(heads_cfg.norm_before_residual):
        raise ConfigError(f"heads.norm_before_residual: the drafter in {cfg_file} has {str(nbr).lower()}; "
                          f"set heads.norm_before_residual={str(nbr).lower()}")
    state = load_weights(weights)  # unreadable or non-finite: named first
    draft_ids = None
    if "d2t" in state:
        d2t = state["d2t"].long()
        draft_ids = d2t + torch.arange(len(d2t))
    size = len(draft_ids) if draft_ids is not None else backbone.vocab_size
    want_size = heads_cfg.draft_vocab or backbone.vocab_size
    if size != want_size:
        raise ConfigError(f"heads.draft_vocab: the drafter in {cfg_file} scores {size} tokens; set "
                          f"heads.draft_vocab={size if size < backbone.vocab_size else 'null'}")
    ours = {n: t for n, t in state.items() if n.startswith(("fc.", "layers.0.", "norm."))}
    if "lm_head.weight" in state:
        if heads_cfg.lm_head == "copy":  # a trainable LM head: the drafter's own
            ours["lm_head.weight"] = state["lm_head.weight"]
        else:  # shared: the backbone's rows stand in for the file's, so they must be the same (up to bf16)
            rows = backbone.lm_head.weight.detach().float().cpu()
            rows = rows[draft_ids] if draft_ids is not None else rows
            theirs = state["lm_head.weight"].float()
            if theirs.shape != rows.shape or not torch.allclose(theirs, rows, rtol=1e-2, atol=1e-3):
                raise ConfigError(f"heads.lm_head: the drafter in {cfg_file} has an LM head of its own (not the "
                                  "backbone's rows for its draft vocabulary); set heads.lm_head=copy")
    return ours, draft_ids
