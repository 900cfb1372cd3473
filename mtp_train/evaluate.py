"""mtp-eval's measurements: every decoding mode and HF `generate` greedy on the same prompts, in one
process, after a warm-up; the quality signals that need no judge; the report, plots and table.

`eval_report.json` holds, under "modes", one object per mode with exactly these keys (ALGORITHMS.md,
"Metrics"): tau (committed tokens per backbone forward after the prefill), alpha (per-depth
acceptance: kept / reached), tokens_per_s, speedup_vs_hf (HF's wall time / the mode's, prefill
included), repetition_ratio (1 - unique / total 4-grams, averaged over outputs), backbone_nll (the
backbone's mean per-token NLL of the output, teacher-forced), greedy_match_rate (outputs identical to
our greedy's; lossy modes), identical_to_greedy, n_prompts, new_tokens. Under "details", per mode:
first_divergence (mean first differing position over outputs that differ), wall_s, prefill_s,
decode_s and accept_hist. Top level: step_cost (forward over k+1 tokens / over 1), the heads'
training-time val/sim_tau next to the measured tau, and the prompts skipped as too long.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from mtp_train.artifacts import write_json_atomic
from mtp_train.errors import DataError

log = logging.getLogger(__name__)
REPORT = "eval_report.json"


# ---------------------------------------------------------------------------------------------------
# prompts


def load_prompts_jsonl(path: Path, tokenizer) -> list[list[int]]:
    """Rows {"prompt": str} (or {"messages": [...]}) rendered with the chat template."""
    from mtp_train.data.template import render_prompt

    path = Path(path)
    if not path.is_file():
        raise DataError(f"eval.prompts: {path} does not exist")
    out = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {line_no}: not JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("messages"), list):
                messages = row["messages"]
            elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
                if not row["prompt"].strip():
                    raise DataError(f"{path}, line {line_no}: empty prompt")
                messages = [{"role": "user", "content": row["prompt"]}]
            else:
                raise DataError(f"{path}, line {line_no}: expected {{\"prompt\": \"...\"}}")
            out.append(render_prompt(tokenizer, messages))
    if not out:
        raise DataError(f"{path}: no prompts in the file")
    return out


def held_out_prompts(data_dir: Path, split: str = "validation") -> list[list[int]]:
    """The prompts of a prepared data split (by default the held-out one): each row's tokens before
    its first labelled (assistant) token, i.e. the rendered conversation up to the generation prompt."""
    from datasets import load_from_disk

    from mtp_train.targets import IGNORE

    if not (Path(data_dir) / "manifest.json").is_file():
        raise DataError(f"{data_dir}: no prepared dataset here; run `mtp-prep` or set eval.prompts")
    rows = load_from_disk(str(data_dir))[split]
    out = []
    for ids, labels in zip(rows["input_ids"], rows["labels"], strict=True):
        first = next((i for i, v in enumerate(labels) if v != IGNORE), None)
        if first:
            out.append(list(ids[:first]))
    if not out:
        raise DataError(f"{data_dir}: the {split} split has no prompt")
    return out


# ---------------------------------------------------------------------------------------------------
# quality signals


def repetition_ratio(tokens: list[int], n: int = 4) -> float:
    """1 - unique n-grams / total n-grams (0 for outputs shorter than n)."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def backbone_nll(backbone, prompt: list[int], output: list[int]) -> float:
    """Mean NLL (nats) the backbone gives the output tokens after the prompt."""
    if not output:
        return 0.0
    ids = torch.tensor([prompt + output], device=backbone.device)
    h = backbone.hidden_states(ids)[0, len(prompt) - 1: -1]  # (n, d) states before each output token
    logp = torch.log_softmax(backbone.logits(h).float(), -1)  # (n, V)
    return float(-logp.gather(-1, ids[0, len(prompt):, None]).mean())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First position where a and b differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------------
# running the modes


def hf_generate(backbone, prompt: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=backbone.tokenizer.pad_token_id or eos[0])
    ids = torch.tensor([prompt], device=backbone.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = backbone.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def summarise(name: str, outputs: list[list[int]], results: list, seconds: float, hf_seconds: float,
              greedy: list[list[int]] | None, nll: list[float], k: int) -> dict:
    steps = sum(r.steps for r in results) if results else 0
    committed = sum(sum(r.accept_lengths) for r in results) if results else 0
    reached = [sum(r.reached[j] for r in results) for j in range(k)] if results else []
    accepted = [sum(r.accepted[j] for r in results) for j in range(k)] if results else []
    hist = [0] * (k + 1)
    for r in results:
        for a in r.accept_lengths:
            hist[min(a, k + 1) - 1] += 1
    new_tokens = sum(len(o) for o in outputs)
    rep = {
        "tau": committed / steps if steps else 1.0,
        "alpha": [a / r if r else None for a, r in zip(accepted, reached, strict=True)],
        "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0,
        "speedup_vs_hf": hf_seconds / seconds if seconds > 0 else 0.0,
        "repetition_ratio": sum(map(repetition_ratio, outputs)) / len(outputs),
        "backbone_nll": sum(nll) / len(nll),
        "greedy_match_rate": None, "identical_to_greedy": None,
        "n_prompts": len(outputs), "new_tokens": new_tokens,
    }
    details = {
        "first_divergence": None, "wall_s": seconds,
        "prefill_s": sum(r.prefill_s for r in results) if results else None,
        "decode_s": sum(r.decode_s for r in results) if results else None,
        "accept_hist": hist if results else None,
    }
    if greedy is not None:
        div = [first_divergence(o, g) for o, g in zip(outputs, greedy, strict=True)]
        rep["greedy_match_rate"] = sum(d is None for d in div) / len(div)
        diffs = [d for d in div if d is not None]
        details["first_divergence"] = sum(diffs) / len(diffs) if diffs else None
        rep["identical_to_greedy"] = not diffs
    return rep, details


def run_modes(backbone, heads, prompts: list[list[int]], cfg, span_policies=None, sim_tau=None) -> dict:
    """Decode every prompt with HF generate and each mode in cfg.modes; returns the report dict."""
    from tqdm.auto import tqdm

    from mtp_train.decoding import CostPolicy, Decoder, EntropyPolicy

    tok = backbone.tokenizer
    eos = sorted({t for t in (tok.eos_token_id, *_as_list(backbone.model.generation_config.eos_token_id))
                  if t is not None})
    dec = Decoder(backbone, heads, eos_ids=eos)
    k = dec.k
    costs = dec.step_costs() if k else [1.0]
    log.info("step cost on this machine: forward over n+1 tokens / over 1 token = %s",
             ", ".join(f"{c:.2f}" for c in costs))

    def run_mode(mode: str, prompt: list[int]):
        opts = {}
        if mode == "relaxed":
            opts = {"delta": cfg.delta, "budget": cfg.budget}
        elif mode in ("clp", "gate", "clp+verify"):
            opts = {"span_policy": span_policies[mode]}
            mode = "clp" if mode == "gate" else mode  # the gate is a span policy in clp mode
        elif mode == "adaptive":
            opts = {"depth_policy": CostPolicy(k, costs) if cfg.adaptive_policy == "cost" else
                    EntropyPolicy(k, cfg.entropy_low, cfg.entropy_high)}
        return dec.generate(prompt, cfg.max_new_tokens, mode, **opts)

    for p in prompts[: cfg.warmup]:  # warm-up: allocator, thread pools, one-time kernels
        hf_generate(backbone, p, min(16, cfg.max_new_tokens), eos)
        for mode in cfg.modes:
            dec.generate(p, min(16, cfg.max_new_tokens), "greedy" if mode == "greedy" else "verify")
    span_policies = span_policies or {}
    bar = tqdm(total=len(prompts) * (len(cfg.modes) + 1), desc="decode", unit="run", dynamic_ncols=True)
    hf_out, hf_s = [], 0.0
    runs = {mode: ([], 0.0) for mode in cfg.modes}
    for p in prompts:  # interleaved per prompt, so that drift in machine speed hits every mode alike
        out, s = hf_generate(backbone, p, cfg.max_new_tokens, eos)
        hf_out.append(out)
        hf_s += s
        bar.update(1)
        for mode in cfg.modes:
            t0 = time.perf_counter()
            r = run_mode(mode, p)
            res, secs = runs[mode]
            res.append(r)
            runs[mode] = (res, secs + time.perf_counter() - t0)
            bar.update(1)
    bar.close()
    greedy = [r.tokens for r in runs["greedy"][0]] if "greedy" in runs else hf_out
    report = {"modes": {}, "details": {}}
    report["modes"]["hf_generate"], report["details"]["hf_generate"] = summarise(
        "hf_generate", hf_out, [], hf_s, hf_s, greedy,
        [backbone_nll(backbone, p, o) for p, o in zip(prompts, hf_out, strict=True)], k)
    for mode, (res, secs) in runs.items():
        outs = [r.tokens for r in res]
        report["modes"][mode], report["details"][mode] = summarise(
            mode, outs, res, secs, hf_s, None if mode == "greedy" else greedy,
            [backbone_nll(backbone, p, o) for p, o in zip(prompts, outs, strict=True)], k)
    report["step_cost"] = costs[-1]
    report["step_costs"] = costs
    report["k"] = k
    report["sim_tau"] = sim_tau
    return report, {m: [r.tokens for r in runs[m][0]] for m in runs} | {"hf_generate": hf_out}


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


# ---------------------------------------------------------------------------------------------------
# presentation


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"decoding, k={report['k']}, step cost {report['step_cost']:.2f}"
              + (f", training sim_tau {report['sim_tau']:.2f}" if report.get("sim_tau") else ""))
    for col in ("mode", "tok/s", "speedup", "tau", "alpha per depth", "rep", "NLL", "greedy match"):
        t.add_column(col, justify="right" if col != "mode" else "left")
    for name, m in report["modes"].items():
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in (m["alpha"] or []))
        match = "-" if m["greedy_match_rate"] is None else f"{m['greedy_match_rate']:.2f}"
        t.add_row(name, f"{m['tokens_per_s']:.1f}", f"{m['speedup_vs_hf']:.2f}x", f"{m['tau']:.2f}",
                  alpha or "-", f"{m['repetition_ratio']:.3f}", f"{m['backbone_nll']:.3f}", match)
    Console().print(t)


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    modes = {n: {**m, **report["details"][n]} for n, m in report["modes"].items()
             if report["details"][n].get("accept_hist")}
    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(report["modes"])
    ax.bar(names, [report["modes"][n]["speedup_vs_hf"] for n in names], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup vs HF generate")
    ax.set_title("speedup per mode")
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    k = report["k"]
    if k and modes:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        width = 0.8 / len(modes)
        for i, (n, m) in enumerate(modes.items()):
            xs = [j + i * width for j in range(k + 1)]
            total = max(1, sum(m["accept_hist"]))
            a1.bar(xs, [c / total for c in m["accept_hist"]], width, label=n)
            al = [a if a is not None else 0 for a in m["alpha"]]
            a2.bar([j + i * width for j in range(k)], al, width, label=n)
        a1.set_xticks([j + 0.4 - width / 2 for j in range(k + 1)], [str(j + 1) for j in range(k + 1)])
        a1.set_xlabel("tokens committed per step")
        a1.set_ylabel("fraction of steps")
        a1.set_title("accepted length")
        a2.set_xticks([j + 0.4 - width / 2 for j in range(k)], [f"d{j + 1}" for j in range(k)])
        a2.set_ylabel("acceptance")
        a2.set_ylim(0, 1)
        a2.set_title("per-depth acceptance")
        a2.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "acceptance.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def save_report(report: dict, out_dir: Path) -> Path:
    path = Path(out_dir) / REPORT
    write_json_atomic(path, report)
    return path
