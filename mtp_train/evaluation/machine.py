"""The machine a measurement ran on and the dtype it decodes in: the CPU's name (part of an
evaluation's key: timings from another machine are not reused), eval.dtype resolved for this
machine, and HF generate timed in both dtypes, so that a dtype change alone cannot pass as a
decoder win.
"""

from __future__ import annotations

import torch

from mtp_train.evaluation.runner import hf_generate


def cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        for line in open(path, encoding="utf-8"):
            key, _, value = line.partition(":")
            if not key.strip() and info:  # the blank line after the first processor
                break
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_model(info: dict[str, str] | None = None) -> str:
    """The CPU's name with its family and model numbers: a VM's name is often only "AMD EPYC",
    which the machine classes this project runs on share (family 23 model 1 is a first-generation
    Zen at 2.0 GHz, 25/1 a Zen 3 with AVX2, 25/17 a Zen 4 with AVX-512). Part of an evaluation's key
    and of every stage record that prices or times something."""
    info = cpuinfo() if info is None else info
    name = info.get("model name")
    if name is None:
        import platform

        return platform.processor() or "unknown"
    if "cpu family" in info and "model" in info:
        return f"{name} (family {info['cpu family']} model {info['model']})"
    return name


def cpu_line() -> str:
    """The CPU as benchmarks print it beside their figures: the name, family and model numbers, the
    vector flags that decide which layouts and dtypes win (AVX2, AVX-512, native bf16, AMX) and the
    threads."""
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{cpu_model(info)}; {' '.join(vector) or 'no avx2'}; {torch.get_num_threads()} threads"


def resolve_dtype(name: str) -> torch.dtype:
    """eval.dtype -> a torch dtype; auto = bf16 where matmuls have native bf16 (AMX, avx512_bf16, a
    GPU), float32 elsewhere. (Without them a bf16 forward over one token may still beat float32's,
    but the cost of a many-token forward grows far faster, and multi-token bf16 forwards round
    differently from one-token ones, so verified output drifts from the bf16 greedy loop;
    docs/decoding.md has the figures.)"""
    from mtp_train.backbone import resolve_autocast

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[resolve_autocast(device, name)]


def machine() -> dict:
    from mtp_train.backbone import cpu_has_native_bf16

    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "native_bf16": cpu_has_native_bf16(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def hf_dtype_probe(backbone, prompts: list[list[int]], eos: list[int], max_new_tokens: int = 32,
                   n_prompts: int = 3) -> dict:
    """HF generate's tokens/s in float32 and in bfloat16 on a few prompts, interleaved (a copy of the
    model in the other dtype), so that a mode's speedup can also be stated against the faster of the
    two: a dtype change alone must not pass as a decoder win."""
    import copy

    here = backbone.model.dtype
    other_dtype = torch.float32 if here == torch.bfloat16 else torch.bfloat16
    other = copy.copy(backbone)
    other.model = copy.deepcopy(backbone.model).to(other_dtype)
    secs = {here: 0.0, other_dtype: 0.0}
    toks = {here: 0, other_dtype: 0}
    hf_generate(other, prompts[0], 4, eos)  # warm the copy
    for i, p in enumerate(prompts[:n_prompts]):
        for b in ((backbone, other) if i % 2 == 0 else (other, backbone)):
            out, s = hf_generate(b, p, max_new_tokens, eos)
            secs[b.model.dtype] += s
            toks[b.model.dtype] += len(out)
    del other
    return {str(d).replace("torch.", ""): toks[d] / secs[d] if secs[d] else 0.0 for d in secs}
