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

Timing runs in eval.rounds rounds; in each, every prompt is decoded by HF generate and every mode in
an order that rotates with the prompt and the round, so no mode always runs first. Outputs and
acceptance come from round 1; speedup_vs_hf and tokens_per_s are medians over the rounds, and the
details add wall_s_rounds, speedup_rounds, speedup_spread ([min, max]), nondeterministic (a later
round's tokens differed from round 1's) and plausible_max_speedup: a step costs at least one
backbone forward, so a mode cannot beat HF by more than 1.15 x tau x max(1, our greedy's speedup);
a mode above that bound is listed in the top-level "flags" (the machine was probably loaded).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from collections.abc import Iterator
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


def dataset_ids(data_dir: Path) -> set[str]:
    """The conversation ids of a prepared dataset, over all of its splits."""
    from datasets import load_from_disk

    if not (Path(data_dir) / "manifest.json").is_file():
        raise DataError(f"{data_dir}: no prepared dataset here; run `mtp-prep stage=data` first")
    ds = load_from_disk(str(data_dir))
    return {str(i) for split in ds for i in ds[split]["id"]}


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """The messages before the first assistant turn, or None when no user turn comes before it."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    head = messages[:first]
    return head if any(m["role"] == "user" for m in head) else None


def unseen_conversations(conversations: list[dict], seen: set[str], seed: int) -> list[dict]:
    """The conversations whose id is not in `seen`, in an order shuffled by `seed`."""
    out = [c for c in conversations if str(c["id"]) not in seen]
    random.Random(seed).shuffle(out)
    return out


def render_prompts(conversations, tokenizer) -> Iterator[list[int]]:
    """Each conversation rendered up to its first assistant turn (lazily: callers stop early)."""
    from mtp_train.data.template import render_prompt

    for conv in conversations:
        messages = prompt_messages(conv["messages"])
        if messages is not None:
            yield render_prompt(tokenizer, messages)


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


def summarise(name: str, outputs: list[list[int]], results: list, seconds, hf_seconds,
              greedy: list[list[int]] | None, nll: list[float], k: int,
              round_tokens: list[int] | None = None) -> tuple[dict, dict]:
    """One mode's report entry and details. `seconds` and `hf_seconds` are the mode's and HF
    generate's wall time per timing round (a number: one round) on the same prompts; speedup and
    tokens/s are medians over the rounds. Outputs and acceptance (`results`) are round 1's;
    `round_tokens` are the new tokens of each round (default: round 1's in every round)."""
    secs, hf = _per_round(seconds), _per_round(hf_seconds)
    if len(secs) != len(hf):
        raise ValueError(f"{name}: {len(secs)} timing rounds against HF generate's {len(hf)}")
    steps = sum(r.steps for r in results) if results else 0
    committed = sum(sum(r.accept_lengths) for r in results) if results else 0
    reached = [sum(r.reached[j] for r in results) for j in range(k)] if results else []
    accepted = [sum(r.accepted[j] for r in results) for j in range(k)] if results else []
    hist = [0] * (k + 1)
    for r in results:
        for a in r.accept_lengths:
            hist[min(a, k + 1) - 1] += 1
    new_tokens = sum(len(o) for o in outputs)
    tokens = list(round_tokens) if round_tokens is not None else [new_tokens] * len(secs)
    speedups = [h / s if s > 0 else 0.0 for h, s in zip(hf, secs, strict=True)]
    rates = [t / s if s > 0 else 0.0 for t, s in zip(tokens, secs, strict=True)]
    rep = {
        "tau": committed / steps if steps else 1.0,
        "alpha": [a / r if r else None for a, r in zip(accepted, reached, strict=True)],
        "tokens_per_s": statistics.median(rates),
        "speedup_vs_hf": statistics.median(speedups),
        "repetition_ratio": sum(map(repetition_ratio, outputs)) / len(outputs),
        "backbone_nll": sum(nll) / len(nll),
        "greedy_match_rate": None, "identical_to_greedy": None,
        "n_prompts": len(outputs), "new_tokens": new_tokens,
    }
    details = {
        "first_divergence": None, "wall_s": statistics.median(secs),
        "prefill_s": sum(r.prefill_s for r in results) if results else None,
        "decode_s": sum(r.decode_s for r in results) if results else None,
        "accept_hist": hist if results else None,
        "wall_s_rounds": secs, "speedup_rounds": speedups, "speedup_spread": [min(speedups), max(speedups)],
        "nondeterministic": False,
    }
    if greedy is not None:
        div = [first_divergence(o, g) for o, g in zip(outputs, greedy, strict=True)]
        rep["greedy_match_rate"] = sum(d is None for d in div) / len(div)
        diffs = [d for d in div if d is not None]
        details["first_divergence"] = sum(diffs) / len(diffs) if diffs else None
        rep["identical_to_greedy"] = not diffs
    return rep, details


def _per_round(x) -> list[float]:
    return [float(v) for v in x] if isinstance(x, (list, tuple)) else [float(x)]


PLAUSIBLE_SLACK = 1.15  # how far timing noise may carry a speedup above what tau allows


def plausible_max_speedup(tau: float, greedy_speedup: float | None) -> float:
    """The most a mode committing `tau` tokens per step can gain over HF generate: each step costs at
    least one backbone forward of one token, i.e. at least one step of our greedy decoder."""
    return PLAUSIBLE_SLACK * tau * max(1.0, greedy_speedup if greedy_speedup is not None else 1.0)


def plausibility_flags(report: dict) -> list[str]:
    """Set details[mode]["plausible_max_speedup"] for every mode that drafts (None for the others)
    and return one line per mode whose speedup is beyond it."""
    greedy = report["modes"].get("greedy")
    greedy_speedup = greedy["speedup_vs_hf"] if greedy else None
    flags = []
    for name, m in report["modes"].items():
        d = report["details"][name]
        if name in ("hf_generate", "greedy") or not report.get("k") or not d.get("accept_hist"):
            d["plausible_max_speedup"] = None
            continue
        bound = plausible_max_speedup(m["tau"], greedy_speedup)
        d["plausible_max_speedup"] = bound
        if m["speedup_vs_hf"] > bound:
            flags.append(f"{name}: speedup {m['speedup_vs_hf']:.2f}x exceeds what tau {m['tau']:.2f} allows "
                         f"(<= {bound:.2f}x); the machine was probably loaded")
    return flags


def round_order(names: list[str], prompt_index: int, round_index: int) -> list[str]:
    """The order in which HF generate and the modes decode one prompt in one round: a rotation by
    prompt index + round index, so that no one of them always runs first (or always last)."""
    shift = (prompt_index + round_index) % len(names)
    return names[shift:] + names[:shift]


def run_modes(backbone, heads, prompts: list[list[int]], cfg, span_policies=None, sim_tau=None) -> dict:
    """Decode every prompt with HF generate and each mode in cfg.modes, in cfg.rounds timing rounds;
    returns the report dict and round 1's outputs per mode."""
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
    rounds = getattr(cfg, "rounds", 1)
    names = ["hf_generate", *cfg.modes]
    bar = tqdm(total=rounds * len(prompts) * len(names), desc="decode", unit="run", dynamic_ncols=True)
    first = {n: [] for n in names}  # round 1: HF's token lists, the modes' DecodeResults
    wall = {n: [0.0] * rounds for n in names}  # seconds per round, over all prompts
    new_tokens = {n: [0] * rounds for n in names}
    nondeterministic = set()
    for r in range(rounds):
        # interleaved per prompt, in a rotating order: drift in machine speed hits every mode alike
        for i, p in enumerate(prompts):
            for name in round_order(names, i, r):
                if name == "hf_generate":
                    res, secs = hf_generate(backbone, p, cfg.max_new_tokens, eos)
                    out = res
                else:
                    t0 = time.perf_counter()
                    res = run_mode(name, p)
                    secs = time.perf_counter() - t0
                    out = res.tokens
                wall[name][r] += secs
                new_tokens[name][r] += len(out)
                if r == 0:
                    first[name].append(res)
                else:
                    ref = first[name][i]
                    if out != (ref if name == "hf_generate" else ref.tokens):
                        nondeterministic.add(name)
                bar.update(1)
    bar.close()
    for name in sorted(nondeterministic):
        log.warning("%s: a later timing round decoded other tokens than round 1 (nondeterministic)", name)
    hf_out = first["hf_generate"]
    outputs = {m: [res.tokens for res in first[m]] for m in cfg.modes}
    greedy = outputs.get("greedy", hf_out)
    report = {"modes": {}, "details": {}}
    for name in names:
        outs = hf_out if name == "hf_generate" else outputs[name]
        results = [] if name == "hf_generate" else first[name]
        report["modes"][name], report["details"][name] = summarise(
            name, outs, results, wall[name], wall["hf_generate"], None if name == "greedy" else greedy,
            [backbone_nll(backbone, p, o) for p, o in zip(prompts, outs, strict=True)], k,
            round_tokens=new_tokens[name])
        report["details"][name]["nondeterministic"] = name in nondeterministic
    report["step_cost"] = costs[-1]
    report["step_costs"] = costs
    report["k"] = k
    report["sim_tau"] = sim_tau
    report["rounds"] = rounds
    report["flags"] = plausibility_flags(report)
    for line in report["flags"]:
        log.warning("%s", line)
    return report, outputs | {"hf_generate": hf_out}


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
        t.add_column(col, justify="right" if col != "mode" else "left", no_wrap=col in ("mode", "speedup"))
    for name, m in report["modes"].items():
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in (m["alpha"] or []))
        match = "-" if m["greedy_match_rate"] is None else f"{m['greedy_match_rate']:.2f}"
        t.add_row(name, f"{m['tokens_per_s']:.1f}", format_speedup(m, report["details"].get(name)),
                  f"{m['tau']:.2f}", alpha or "-", f"{m['repetition_ratio']:.3f}", f"{m['backbone_nll']:.3f}",
                  match)
    console = Console()
    if not console.is_terminal:  # a log file: room for the spread, not rich's 80-column default
        console = Console(width=max(console.width, 120))
    console.print(t)
    if report.get("rounds", 1) > 1:
        console.print(f"speedup: median of {report['rounds']} timing rounds (min-max in brackets)")
    for line in report.get("flags") or []:
        console.print(f"[bold red]flag[/]: {line}", highlight=False, soft_wrap=True)


def format_speedup(mode: dict, details: dict | None) -> str:
    """'1.21x', or '1.21x (1.15-1.30)' with the spread over timing rounds when there were several."""
    text = f"{mode['speedup_vs_hf']:.2f}x"
    spread = (details or {}).get("speedup_spread")
    if spread and len((details or {}).get("speedup_rounds") or []) > 1:
        text += f" ({spread[0]:.2f}-{spread[1]:.2f})"
    return text


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
    speed = [report["modes"][n]["speedup_vs_hf"] for n in names]
    spread = [report["details"][n].get("speedup_spread") or [s, s] for n, s in zip(names, speed, strict=True)]
    ax.bar(names, speed, color="tab:blue",  # error bars: min and max over the timing rounds
           yerr=[[max(0.0, s - lo) for s, (lo, _) in zip(speed, spread, strict=True)],
                 [max(0.0, hi - s) for s, (_, hi) in zip(speed, spread, strict=True)]], capsize=3)
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
