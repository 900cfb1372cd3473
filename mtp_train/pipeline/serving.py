"""Trained heads in the serving engines' own formats (`mtp-export-heads --format eagle3|medusa`),
with the backbone they were trained against. docs/serving.md says how each engine loads them.

- eagle3: the `speculators` "eagle3" layout that vLLM and SGLang load for Llama targets: config.json
  (speculators_model_type "eagle3", a one-layer Llama `transformer_layer_config`, the draft
  vocabulary's size, `norm_before_residual` written out, the auxiliary layer ids, and the algorithm,
  proposal method and verifier) and model.safetensors (fc, layers.0.*, norm, lm_head, and the d2t /
  t2d vocabulary maps when the draft vocabulary is smaller than the backbone's), plus the backbone's
  token embedding, which speculators saves with a drafter and its loader needs (engines that share
  the target's embedding ignore it).
- medusa: vLLM's Medusa layout: a minimal config.json (vLLM rewrites keys that name heads or layers)
  and blocks.{i}.layers.{l}.{weight,bias}, lm_heads.{i}.weight (only lm_heads.0 with
  original_lm_head, the backbone's own head) and token_map for a draft vocabulary.

Heads trained jointly with LoRA adapters draft for the adapted backbone: the export then holds that
backbone too, the adapters merged into its weights (<out>/merged_backbone), and names it as the one to serve.

A family a format cannot express is refused with the reason.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from mtp_train import layout
from mtp_train.errors import MtpError
from mtp_train.heads.registry import EXPORT_FORMATS

log = logging.getLogger(__name__)

SERVING_FILE = "mtp_serving.json"  # what the export holds, which backbone to serve it with, and how
MERGED_DIR = "merged_backbone"  # heads trained with LoRA adapters: the adapted backbone, merged, to serve them with
WEIGHTS_FILE = "model.safetensors"


def format_refusal(family_name: str, fmt: str) -> str | None:
    """Why heads of `family_name` cannot be written in engine format `fmt` (None: they can)."""
    from mtp_train.heads.registry import family, family_for_format

    fam = family(family_name)
    if fam.engine_format == fmt:
        return None
    if fam.engine_format is None:
        return fam.no_engine_format
    holds = family_for_format(fmt)
    return (f"{fam.name} heads are {fam.what}; the {fmt} format holds {holds.name} heads, {holds.what} "
            f"(train heads={holds.name}, or export these as {fam.engine_format})")


def export_for_engine(run_dir: Path, fmt: str, out: Path | None = None) -> Path:
    """Write the run's trained heads in `fmt` to `out` (default <run>/export-<fmt>), atomically; a
    backbone built in code (the tiny test model) is saved beside them in <out>/backbone."""
    from mtp_train.backbone import load_backbone
    from mtp_train.heads.persist import load_heads
    from mtp_train.pipeline.export import load_recipe

    if fmt not in EXPORT_FORMATS or fmt == "native":
        raise MtpError(f"--format: {fmt!r} is not an engine format (choose from eagle3, medusa)")
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / f"export-{fmt}"
    check_destination(out, run_dir)  # before any loading: a refused --out costs nothing
    meta_file = run_dir / layout.HEADS_META
    if not (run_dir / layout.HEADS_FILE).is_file() or not meta_file.is_file():
        raise MtpError(f"{run_dir}: no trained heads here ({layout.HEADS_FILE} and {layout.HEADS_META}); "
                       f"train them with mtp-train, or write them from a checkpoint with "
                       f"`mtp-export-heads {run_dir} --format native`")
    cfg = load_recipe(run_dir)
    family = cfg.heads.type
    if (why := format_refusal(family, fmt)) is not None:
        raise MtpError(f"{run_dir}: {family} heads cannot be exported as {fmt}: {why}")
    backbone = load_backbone(cfg.backbone)
    heads, meta = load_heads(run_dir, backbone)  # refuses non-finite weights and another backbone
    if meta.get("head_type", family) != family:
        raise MtpError(f"{meta_file}: holds {meta.get('head_type')} heads, but the run's recipe says "
                       f"heads={family}; export them from the run that trained them")
    recipe = meta.get("recipe") or {}
    # trained here, exported from a checkpoint, or a drafter speculators trained, read back (heads.from_speculators)
    trained = (recipe.get("steps", 0) >= 1 or "exported_from" in (meta.get("metrics") or {})
               or bool(recipe.get("from_speculators")))
    if not trained:
        raise MtpError(f"{meta_file}: records no training step; these heads are untrained (run mtp-train)")
    return write_for_engine(heads, backbone, cfg.backbone, fmt, out, source=run_dir)


def write_for_engine(heads, backbone, backbone_cfg, fmt: str, out: Path, source: Path | None = None) -> Path:
    """Write `heads` (trained on `backbone`, loaded from `backbone_cfg`) in `fmt` to `out`, atomically;
    a backbone built in code (the tiny test model) is saved beside them in <out>/backbone."""
    from mtp_train.artifacts import publish_dir, temp_dir_for

    if fmt == "eagle3":
        check_engine_layers(heads.aux_layers, source or out)
    out = Path(out)
    check_destination(out, source)
    tmp = temp_dir_for(out)
    tmp.mkdir(parents=True)
    from mtp_train.adapters import has_adapters, merged_backbone

    serve_dir = backbone_for_serving(backbone_cfg)
    check_dir = serve_dir
    adapted = has_adapters(backbone.model)
    # saved with the export: the adapted model, merged (heads trained with LoRA adapters draft for it),
    # or a backbone built in code (the tiny test model); otherwise the engine reads serve_dir itself
    saved = ((MERGED_DIR, merged_backbone(backbone.model)) if adapted else
             ("backbone", backbone.model) if serve_dir is None else None)
    if saved is not None:
        name, model = saved
        check_dir = tmp / name
        model.save_pretrained(check_dir, safe_serialization=True)
        backbone.tokenizer.save_pretrained(check_dir)
        serve_dir = out.resolve() / name
    if fmt == "eagle3":
        config, state = eagle3_files(heads, backbone, serve_dir)
    else:
        config, state = medusa_files(heads, backbone)
    write_export(tmp, config, state)
    # read where it is written now, named where it will be (not the temporary directory)
    notes = [n.replace(str(tmp), str(out.resolve())) for n in backbone_notes(check_dir, backbone)]
    (tmp / SERVING_FILE).write_text(json.dumps({
        "format": fmt, "heads": str(Path(source).resolve()) if source else None, "k": heads.k,
        "draft_size": heads.draft_size, "backbone": str(serve_dir), "backbone_fingerprint": backbone.fingerprint(),
        # the fingerprint is always the original weights'; with adapters the target adds them, merged
        "lora_adapter": (backbone.adapter or "trained in this process") if adapted else None,
        "serve": serve_commands(fmt, serve_dir, out.resolve(), heads.k), "backbone_notes": notes,
        # every file the export wrote: a later export over it refuses to delete anything else
        "files": sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()),
    }, indent=2) + "\n")
    publish_dir(tmp, out)
    for note in notes:
        log.warning("%s", note)
    log.info("%s heads written to %s; serve them with the backbone at %s", fmt, out, serve_dir)
    return out


def _not_written_by_the_export(out: Path) -> list[str]:
    """Files under an earlier export that it did not write (its SERVING_FILE lists them; exports from
    before that list are judged by their top level only)."""
    try:
        written = json.loads((out / SERVING_FILE).read_text()).get("files")
    except (OSError, json.JSONDecodeError, AttributeError):
        return []
    if not isinstance(written, list):
        return []
    have = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() or p.is_symlink()}
    return sorted(have - set(written) - {SERVING_FILE})


# everything an export writes (write_for_engine): a directory holding anything else is not only ours
EXPORT_ITEMS = {"config.json", WEIGHTS_FILE, SERVING_FILE, "backbone", MERGED_DIR}


def check_destination(out: Path, run_dir: Path | None) -> None:
    """An export replaces its directory whole, so it writes only where that loses nothing: a new or
    empty directory, or an earlier export (it holds SERVING_FILE); never the run itself, nor a
    directory that holds the run, nor a non-empty directory of someone else's, nor over a file."""
    out = Path(out)
    if out.is_symlink():  # the export is replaced whole: a link would be replaced, not what it names
        raise MtpError(f"--out {out}: a symbolic link (to {os.readlink(out)}); an export replaces its directory "
                       "whole, so name the real directory (or a new one)")
    if out.exists() and not out.is_dir():
        raise MtpError(f"--out {out}: a file is there; name a directory for the export (it is never "
                       "written over a file)")
    if (there := next(p for p in (out, *out.absolute().parents) if p.exists())) != out and not there.is_dir():
        raise MtpError(f"--out {out}: {there} is a file, so no directory can be made under it")
    try:  # the export is built beside its destination: that directory must exist and take files
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MtpError(f"--out {out}: cannot create {e.filename or out.parent} ({e.strerror})") from None
    if run_dir is not None:
        run, target = Path(run_dir).resolve(), out.resolve()
        if target == run or target in run.parents:
            raise MtpError(f"--out {out}: the run directory {run_dir} is {'this directory' if target == run else 'inside it'}; "
                           "an export replaces the directory it is written to and would delete the run's "
                           f"files. Leave --out out (default <run>/export-<format>) or name a new directory")
    if out.is_dir() and not (out / SERVING_FILE).is_file() and any(out.iterdir()):
        raise MtpError(f"--out {out}: a directory with files in it that is not an earlier export (no "
                       f"{SERVING_FILE}); an export replaces its directory whole, so it writes only to a "
                       "new or empty directory or over an earlier export")
    if out.is_dir() and (foreign := sorted(p.name for p in out.iterdir() if p.name not in EXPORT_ITEMS)
                         or _not_written_by_the_export(out)):
        raise MtpError(f"--out {out}: an earlier export that now also holds {', '.join(foreign[:3])}"
                       f"{' ...' if len(foreign) > 3 else ''}, which an export does not write; it would be "
                       "deleted with the old export: move it out first, or name a new directory")


def write_export(tmp: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    from mtp_train.artifacts import check_finite

    check_finite(state, str(tmp / WEIGHTS_FILE))
    # a backbone that ties its embedding to its head hands both in as one tensor; safetensors refuses
    # shared storage, and the engine reads each name on its own, so each gets its own copy
    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        t = t.detach().contiguous().cpu()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    save_file(tensors, str(tmp / WEIGHTS_FILE))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# --- EAGLE-3 ------------------------------------------------------------------------------------

def check_engine_layers(aux_layers: list[int], where) -> None:
    """What the engines can serve: vLLM's EAGLE-3 fc reads exactly three layers, and an engine that
    records the input of layer 0 adds a residual that does not exist yet there (and SGLang, which
    names layer outputs, cannot name the embeddings)."""
    if len(aux_layers) != 3:
        raise MtpError(f"{where}: EAGLE-3 heads fusing {len(aux_layers)} layers ({aux_layers}); vLLM's "
                       "drafter reads exactly 3 (train with three heads.aux_layers)")
    if 0 in aux_layers:
        raise MtpError(f"{where}: EAGLE-3 heads read layer 0 (the embeddings), which vLLM and SGLang do "
                       "not record; train with heads.aux_layers >= 1")


def eagle3_files(heads, backbone, serve_dir: Path) -> tuple[dict, dict]:
    """(config.json, weights) in the speculators eagle3 layout."""
    layer_cfg = heads.layer_config.to_diff_dict()
    layer_cfg.pop("transformers_version", None)
    theta = rope_theta(heads.layer_config)
    layer_cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                     hidden_size=heads.hidden_size, vocab_size=heads.vocab_size, rope_theta=theta)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": heads.draft_size,
        "norm_before_residual": bool(heads.norm_before_residual),  # written out: the engines' defaults differ
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(heads.aux_layers),
        # SGLang reads its own key, naming the layer whose output is taken (the input of the next)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in heads.aux_layers]},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": heads.k,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": str(serve_dir),
                         "architectures": list(getattr(backbone.config, "architectures", None)
                                               or [type(backbone.model).__name__])},
        },
    }
    state = {n: t for n, t in heads.state_dict().items() if n != "draft_ids"}
    state["lm_head.weight"] = heads.lm_weight(backbone.lm_head).detach()
    # the backbone's embedding, as speculators saves it: without it its loader keeps a random init
    state["embed_tokens.weight"] = backbone.embed_tokens.weight.detach()
    if heads.draft_size < heads.vocab_size:
        state["d2t"], state["t2d"] = heads.d2t(), heads.t2d()
    return config, {n: t.float() if t.is_floating_point() else t for n, t in state.items()}



# --- Medusa -------------------------------------------------------------------------------------

def medusa_files(heads, backbone) -> tuple[dict, dict]:
    """(config.json, weights) in vLLM's Medusa layout."""
    shared = not heads.per_depth_lm
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": heads.hidden_size,
              "vocab_size": heads.vocab_size, "num_heads": heads.k,
              "num_hidden_layers": len(heads.blocks[0]), "truncated_vocab_size": heads.draft_size,
              "medusa_fc_bias": True, "original_lm_head": shared}
    state = {}
    for i, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            state[f"blocks.{i}.layers.{j}.weight"] = res.linear.weight.float()
            state[f"blocks.{i}.layers.{j}.bias"] = res.linear.bias.float()
    if shared:  # the backbone's head (its draft-vocabulary rows), which the file must carry
        state["lm_heads.0.weight"] = heads.draft_weight(backbone.lm_head).float()
    else:
        for i, head in enumerate(heads.lm_heads):
            state[f"lm_heads.{i}.weight"] = head.weight.float()
    if heads.draft_size < heads.vocab_size:
        state["token_map"] = heads.draft_ids.long()
    return config, state


# --- the backbone to serve with -------------------------------------------------------------------

def backbone_for_serving(bcfg) -> Path | None:
    """Where the weights the heads were trained against are: the converted GGUF (SmolLM2's is
    dequantised from Q4_1, not the hub's weights), the given HF directory or hub id; None for a
    backbone built in code (the export then saves a copy beside the heads)."""
    src = bcfg.source
    if src == "gguf":
        return Path(bcfg.converted_dir).resolve()
    if src == "hf":
        local = Path(bcfg.path).expanduser()
        return local.resolve() if local.is_dir() else Path(bcfg.path)  # a hub id: fetched by name
    return None


def rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def backbone_notes(serve_dir: Path, backbone) -> list[str]:
    """What an engine reading `serve_dir`'s config.json would get wrong about this backbone: refused
    when it would serve another model, noted when only older engines would misread it."""
    cfg_file = Path(serve_dir) / "config.json"
    if not cfg_file.is_file():
        return [f"{serve_dir}: not a local directory; the engine loads it by name (check it is the same "
                "weights the heads were trained on)"]
    disk = json.loads(cfg_file.read_text())
    have = backbone.config
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "model_type"):
        if disk.get(key) != getattr(have, key, None):
            raise MtpError(f"{cfg_file}: {key}={disk.get(key)!r}, but the heads were trained on a backbone "
                           f"with {key}={getattr(have, key, None)!r}")
    theta = rope_theta(have)
    on_disk = (disk.get("rope_parameters") or {}).get("rope_theta", disk.get("rope_theta"))
    if theta is not None and on_disk is None:
        raise MtpError(f"{cfg_file}: carries no RoPE theta (the backbone uses {theta}); an engine would "
                       "assume 10000 and serve another model")
    if on_disk is not None and theta is not None and abs(float(on_disk) - float(theta)) > 1e-6 * float(theta):
        raise MtpError(f"{cfg_file}: RoPE theta {on_disk}, but the backbone the heads were trained on uses {theta}")
    notes = []
    if "rope_theta" not in disk:
        notes.append(f"{cfg_file}: RoPE theta {on_disk} is given only as rope_parameters.rope_theta "
                     "(transformers 5); engines that read only a top-level rope_theta would assume 10000")
    return notes


def serve_commands(fmt: str, backbone: Path, heads: Path, k: int) -> dict:
    """The engines' command lines for this export (not run here: no GPU, no engine), every argument
    shell-quoted: a path with spaces or quotes pastes as one argument and never as shell code."""
    from shlex import quote

    method = {"eagle3": "eagle3", "medusa": "medusa"}[fmt]
    spec = json.dumps({"method": method, "model": str(heads), "num_speculative_tokens": k})
    out = {"vllm": f"vllm serve {quote(str(backbone))} --speculative-config {quote(spec)}"}
    if fmt == "eagle3":
        out["sglang"] = (f"python -m sglang.launch_server --model-path {quote(str(backbone))} --speculative-algorithm "
                         f"EAGLE3 --speculative-draft-model-path {quote(str(heads))} --speculative-num-steps {k} "
                         f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    return out
