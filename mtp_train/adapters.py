"""LoRA adapters on the backbone (peft), trained jointly with the heads (`backbone.lora.enabled`).

The adapters are injected in place into the backbone's linears (`peft.inject_adapter_in_model`), so
every consumer that runs the backbone (training, the decoder, HF generate, CLP labels) runs the
adapted model without knowing it. What this module adds around peft:

- `adapter_modules`: the adapters' own layers gathered into one nn.Module, which the LightningModule
  registers, so that Lightning's optimizer, DDP's gradient reduction and checkpoints see exactly
  the heads and the adapters, never the frozen base weights;
- `adapters_disabled`: the original backbone for the same weights in memory (the distillation term's
  reference, the evaluator's drift);
- `save_adapter` / `attach_adapter`: a run's adapters as a PEFT adapter directory (adapter_config.json
  + adapter_model.safetensors, loadable with `PeftModel.from_pretrained`), read back with safetensors;
- `merge_adapters` and `merged_backbone`: the adapted weights folded into the base ones (faster
  decoding; the target model an engine serves).
See docs/algorithms.md, "Joint training with LoRA adapters".
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from mtp_train.config import LoraConfig
from mtp_train.errors import MtpError

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"  # peft's name for the one adapter a backbone carries here
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"  # PEFT's own names
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the model's own names


def add_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject LoRA adapters in place (peft); only the adapters get requires_grad=True. The B
    matrices start at zero, so the adapted model starts equal to the original."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules))
    out_head = model.get_output_embeddings()  # before injection (peft may wrap it)
    try:
        inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise MtpError(f"backbone.lora.target_modules: {list(cfg.target_modules)} ({str(e).splitlines()[0]})") from None
    for name, layer in lora_layers(model):
        base = layer.get_base_layer()
        if type(base) is not nn.Linear or base is out_head:
            # the heads read the LM head's and the embedding's base weights directly
            raise MtpError(f"backbone.lora.target_modules: {name} is {'the LM head' if base is out_head else type(base).__name__}; "
                           "adapters go on the transformer layers' linears (q_proj, k_proj, v_proj, o_proj, "
                           "gate_proj, up_proj, down_proj)")
        layer.train(model.training)  # peft builds its dropout in training mode; follow the model's
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()  # float32 adapters on a half-precision backbone (as PeftModel does)
    return model


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every peft LoRA layer in the model, in module order."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_adapters(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def adapter_modules(model: nn.Module) -> nn.ModuleDict | None:
    """The adapters' lora_A / lora_B layers under one module (None without adapters). They are the
    same objects the backbone runs: training them through this container trains the backbone's."""
    layers = lora_layers(model)
    if not layers:
        return None
    # lora_dropout has no weights: registered so that train() / eval() reach it, checkpoints unchanged
    return nn.ModuleDict({name.replace(".", "__"): nn.ModuleDict(
        {"lora_A": m.lora_A, "lora_B": m.lora_B, "lora_dropout": m.lora_dropout}) for name, m in layers})


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block the backbone computes as the original (adapters bypassed, weights untouched).
    Their requires_grad flags are restored after. Refused once the adapters are merged into the
    weights: taking them out again would not give the original weights back exactly."""
    layers = [m for _, m in lora_layers(model)]
    if any(m.merged for m in layers):
        raise MtpError("the LoRA adapters are merged into the backbone's weights; the original model is "
                       "no longer in memory (measure against it before merging)")
    flags = [(p, p.requires_grad) for m in layers for d in (m.lora_A, m.lora_B) for p in d.parameters()]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights under PEFT's file names (adapter name removed)."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    return {PEFT_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in state.items()}


def save_adapter(model: nn.Module, out: Path, base_model: str | None = None) -> Path:
    """Write the backbone's adapters as a PEFT adapter directory, atomically (temp dir, then rename)."""
    from safetensors.torch import save_file

    from mtp_train.artifacts import check_finite, publish_dir, temp_dir_for

    state = adapter_state(model)
    check_finite(state, f"{out}: not written, the adapters diverged (lower train.lr or backbone.lora.lr)")
    cfg = model.peft_config[ADAPTER_NAME]
    tmp = temp_dir_for(out)
    tmp.mkdir()
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    settings = cfg.to_dict()
    settings.update(base_model_name_or_path=base_model, inference_mode=True)
    settings["target_modules"] = sorted(settings["target_modules"]) if isinstance(
        settings.get("target_modules"), (set, list)) else settings.get("target_modules")
    (tmp / CONFIG_FILE).write_text(json.dumps(settings, indent=2, default=str) + "\n")
    publish_dir(tmp, out)
    return out


def read_adapter(adapter_dir: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The LoRA settings and weights of a PEFT adapter directory (safetensors only), refused with the
    file's name when either is missing, damaged or not LoRA."""
    from mtp_train.artifacts import load_weights, read_weights_meta

    raw, cfg_file, weights = read_weights_meta(Path(adapter_dir), CONFIG_FILE, WEIGHTS_FILE,
                                               "a PEFT adapter written by mtp-train")
    if raw.get("peft_type") not in ("LORA", None):
        raise MtpError(f"{cfg_file}: peft_type {raw.get('peft_type')!r}; only LoRA adapters are supported")
    try:
        cfg = LoraConfig(enabled=True, r=int(raw["r"]), alpha=int(raw["lora_alpha"]),
                         dropout=float(raw.get("lora_dropout") or 0.0),
                         target_modules=sorted(raw["target_modules"]))
    except (KeyError, TypeError, ValueError) as e:
        raise MtpError(f"{cfg_file}: not a usable LoRA config ({e})") from None
    return cfg, load_weights(weights)


def attach_adapter(model: nn.Module, adapter_dir: Path) -> LoraConfig:
    """Give the backbone the adapters of `adapter_dir` (injecting them first when it has none), frozen.
    Every adapter weight must find its layer, and every layer its weights."""
    from peft.utils.save_and_load import set_peft_model_state_dict

    cfg, state = read_adapter(adapter_dir)
    if not has_adapters(model):
        add_lora(model, cfg)
    else:
        have = model.peft_config[ADAPTER_NAME]
        if (have.r, have.lora_alpha, sorted(have.target_modules)) != (cfg.r, cfg.alpha, cfg.target_modules):
            raise MtpError(f"{adapter_dir}: LoRA r={cfg.r}, alpha={cfg.alpha} on {cfg.target_modules}, but the "
                           f"backbone already carries r={have.r}, alpha={have.lora_alpha} on "
                           f"{sorted(have.target_modules)} (backbone.lora); leave backbone.lora.enabled=false")
    device = next(model.parameters()).device
    expected = set(adapter_state(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise MtpError(f"{adapter_dir / WEIGHTS_FILE}: does not match this backbone's LoRA layers "
                       f"(missing {missing[:3]}, unexpected {extra[:3]})")
    plain = {n[len(PEFT_PREFIX):]: t.to(device) for n, t in state.items()}
    result = set_peft_model_state_dict(model, plain, adapter_name=ADAPTER_NAME)
    if getattr(result, "unexpected_keys", None):
        raise MtpError(f"{adapter_dir / WEIGHTS_FILE}: peft left keys unused: {result.unexpected_keys[:3]}")
    for p in model.parameters():
        p.requires_grad_(False)
    return cfg


def attach_run_adapter(run_dir: Path, record: dict, backbone) -> Path:
    """The adapters a training run saved beside its heads (heads.json's "adapter" record), checked
    against the hash recorded there, given to `backbone`; its identity then names them, so that
    caches of the original backbone's states are not taken for the adapted one's."""
    from mtp_train.artifacts import file_sha256

    name = record.get("dir") or "adapter"
    d = Path(run_dir) / str(name)
    run = Path(run_dir).resolve()
    if not isinstance(name, str) or d.resolve().parent != run:  # mtp-train writes <run>/adapter
        raise MtpError(f"{run_dir}: heads.json's adapter.dir {name!r} is not a directory inside the run; "
                       "the adapters a run trained are saved in it (edited, or damaged)")
    weights = d / WEIGHTS_FILE
    if not weights.is_file():
        raise MtpError(f"{run_dir}: heads.json says the heads were trained with LoRA adapters, but {weights} "
                       "is missing; the heads are wrong without them")
    if record.get("sha256") not in (None, file_sha256(weights)):
        raise MtpError(f"{weights}: not the adapters these heads were trained with (sha256 differs from "
                       "heads.json's record)")
    attach_adapter(backbone.model, d)
    backbone.identity = {**(backbone.identity or {}), "adapter": record.get("sha256")}
    backbone.adapter = str(d)
    log.info("the backbone carries the LoRA adapters of %s: decoding verifies against the adapted model", d)
    return d


def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W + scale * B A) for decoding speed; returns how
    many layers were merged. After this the original model is gone (`adapters_disabled` refuses)."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        if not m.merged:
            m.merge()
    return len(layers)


def merged_backbone(model: nn.Module) -> nn.Module:
    """A copy of the adapted backbone as a plain transformers model (each adapter folded into its
    base weight, the LoRA layer replaced by that base layer), for engines that serve the target
    model; the model passed in is not changed."""
    import copy

    clone = copy.deepcopy(model)
    with torch.no_grad():
        for name, layer in lora_layers(clone):
            layer.merge(safe_merge=True)
            parent, _, attr = name.rpartition(".")
            setattr(clone.get_submodule(parent) if parent else clone, attr, layer.get_base_layer())
    if hasattr(clone, "peft_config"):
        del clone.peft_config
    return clone
