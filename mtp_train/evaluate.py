"""mtp-eval's measurements: every decoding mode and HF `generate` greedy on the same prompts, in one
process, after a warm-up; the quality signals that need no judge; the report, plots and table.

`eval_report.json` holds, under "modes", one object per mode with exactly these keys (docs/algorithms.md,
"Metrics"): tau (committed tokens per backbone forward after the prefill), alpha (per-depth
acceptance: kept / reached), tokens_per_s, speedup_vs_hf (HF's wall time / the mode's, prefill
included), repetition_ratio (1 - unique / total 4-grams, averaged over outputs), backbone_nll (the
backbone's mean per-token NLL of the output, teacher-forced), greedy_match_rate (outputs identical to
our greedy's; lossy modes), identical_to_greedy, n_prompts, new_tokens, speedup_vs_best_hf (against
the faster of fp32 and bf16 HF generate, from `hf_dtype_probe`). Under "details", per mode:
first_divergence (mean first differing position over outputs that differ), wall_s, prefill_s,
decode_s and accept_hist; for lossless modes also divergence_margins (per prompt, at the first token
that differs from greedy's: how far the backbone preferred greedy's token, in nats and in the dtype's
rounding steps), max_divergence_ulps / _nats, and the differences counted by kind: divergences,
divergences_judged, divergences_at_near_ties, divergences_greedy_led, divergences_mode_led.
Top level: step_cost (forward over k+1 tokens / over 1), the heads' training-time val/sim_tau next
to the measured tau, the prompts skipped as too long, "divergence" (one line per lossless
mode that is not identical to greedy: rounding at near-ties, or tokens the backbone did not choose),
and "decoder": the matmul layout, dtype, verify cost curve and the trees weighed against it
(docs/decoding.md).

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
from mtp_train.backbone import eos_ids
from mtp_train.choices import EVAL_MODES, LOSSLESS_EVAL_MODES
from mtp_train.errors import DataError
from mtp_train.layout import ACCEPTANCE_PNG, EVAL_REPORT, MANIFEST, SPEEDUP_PNG, VERIFY_COSTS_PNG

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# prompts


def checked_messages(raw: list, where: str) -> list[dict]:
    """A prompt's messages with the roles the data stage knows (`sources.ROLE_MAP`, ShareGPT names
    included) and text content; anything else is refused naming the line and the message."""
    from mtp_train.data.sources import ROLE_MAP

    if not raw:
        raise DataError(f"{where}: empty messages list")
    out = []
    for i, m in enumerate(raw):
        role = ROLE_MAP.get(str(m.get("role", m.get("from", ""))).lower()) if isinstance(m, dict) else None
        content = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if role is None:
            raise DataError(f"{where}: message {i} has an unknown role "
                            f"{(m.get('role', m.get('from')) if isinstance(m, dict) else m)!r} "
                            f"(known: {', '.join(sorted(set(ROLE_MAP)))})")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} has no text content")
        out.append({**{k: v for k, v in m.items() if k not in ("from", "value")}, "role": role,
                    "content": content})  # other keys (name, tool_calls) stay for the template
    if not any(m["role"] == "user" for m in out):
        raise DataError(f"{where}: no user message (the data stage drops such rows too)")
    return out


def load_prompts_jsonl(path: Path, tokenizer) -> list[list[int]]:
    """Rows {"prompt": str} (or {"messages": [...]}) rendered with the chat template."""
    from jinja2 import TemplateError

    from mtp_train.data.template import render_prompt

    path = Path(path)
    if path.is_dir():
        raise DataError(f"eval.prompts: {path} is a directory; expected a JSONL file of prompts")
    if not path.is_file():
        raise DataError(f"eval.prompts: {path} does not exist")
    out = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x}, the "
                                f"line's byte {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {line_no}: not JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("messages"), list):
                messages = checked_messages(row["messages"], f"{path}, line {line_no}")
            elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
                if not row["prompt"].strip():
                    raise DataError(f"{path}, line {line_no}: empty prompt")
                messages = [{"role": "user", "content": row["prompt"]}]
            else:
                raise DataError(f"{path}, line {line_no}: expected {{\"prompt\": \"...\"}}")
            try:
                out.append(render_prompt(tokenizer, messages))
            except TemplateError as e:
                raise DataError(f"{path}, line {line_no}: the chat template refused these messages ({e})") from None
    if not out:
        raise DataError(f"{path}: no prompts in the file")
    return out


def row_prompt(ids: list[int], labels: list[int]) -> list[int] | None:
    """A prepared row's tokens before its first labelled (assistant) token; None without one."""
    from mtp_train.targets import IGNORE

    first = next((i for i, v in enumerate(labels) if v != IGNORE), None)
    return list(ids[:first]) if first else None


def held_out_prompts(data_dir: Path, split: str = "validation") -> list[list[int]]:
    """The prompts of a prepared data split (by default the held-out one): each row's tokens before
    its first labelled (assistant) token, i.e. the rendered conversation up to the generation prompt."""
    from datasets import load_from_disk

    if not (Path(data_dir) / MANIFEST).is_file():
        raise DataError(f"{data_dir}: no prepared dataset here; run `mtp-prep` or set eval.prompts")
    rows = load_from_disk(str(data_dir))[split]
    out = [p for p in map(row_prompt, rows["input_ids"], rows["labels"]) if p]
    if not out:
        raise DataError(f"{data_dir}: the {split} split has no prompt")
    return out


def dataset_ids(data_dir: Path) -> set[str]:
    """The conversation ids of a prepared dataset, over all of its splits."""
    from datasets import load_from_disk

    if not (Path(data_dir) / MANIFEST).is_file():
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


def divergence_margin(backbone, prompt: list[int], reference: list[int], output: list[int]) -> dict | None:
    """Where `output` first leaves `reference` (greedy), how far the backbone preferred the reference's
    token there, from one teacher-forced forward over the prompt and the shared prefix: `nats`, the
    logit (= log-probability) difference, and `ulps`, that difference over the model dtype's rounding
    step at those logits (eps x the larger |logit|). Lossless decoding that diverges only by rounding
    (a multi-token bf16 forward against a one-token one) leaves near-ties of a few rounding steps; a
    wrong verification leaves a token the backbone did not want, nats and hundreds of steps behind.
    None when the two are identical or one stops where the other goes on (no competing token)."""
    at = first_divergence(output, reference)
    if at is None or at >= min(len(output), len(reference)):
        return None
    ids = torch.tensor([prompt + reference[:at]], device=backbone.device)
    with torch.inference_mode():
        logits = backbone.logits(backbone.hidden_states(ids)[0, -1])
    eps = torch.finfo(logits.dtype).eps
    want, got = float(logits[reference[at]]), float(logits[output[at]])
    return {"nats": want - got, "ulps": (want - got) / (eps * max(abs(want), abs(got), 1.0))}


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


def backbone_drift(backbone, prompts: list[list[int]], eos: list[int], max_new_tokens: int) -> dict:
    """How far LoRA adapters moved the backbone, on the evaluation's prompts: the adapted and the
    original model's greedy answers (HF generate, untimed) compared token by token, and the NLL the
    original gives each. `greedy_match_rate`: answers identical; `prefix_match`: mean fraction of
    the original's answer reproduced before the first difference; `nll_increase`: the original's
    NLL on the adapted answers minus on its own."""
    from tqdm.auto import tqdm

    from mtp_train.adapters import adapters_disabled

    bar = tqdm(total=2 * len(prompts), desc="backbone drift", unit="prompt", dynamic_ncols=True)
    adapted = []
    for p in prompts:
        adapted.append(hf_generate(backbone, p, max_new_tokens, eos)[0])
        bar.update(1)
    with adapters_disabled(backbone.model):
        original = []
        for p in prompts:
            original.append(hf_generate(backbone, p, max_new_tokens, eos)[0])
            bar.update(1)
        nll_adapted = [backbone_nll(backbone, p, o) for p, o in zip(prompts, adapted, strict=True)]
        nll_original = [backbone_nll(backbone, p, o) for p, o in zip(prompts, original, strict=True)]
    bar.close()
    div = [first_divergence(a, o) for a, o in zip(adapted, original, strict=True)]
    prefix = [(len(o) if d is None else d) / max(1, len(o)) for d, o in zip(div, original, strict=True)]
    n = len(prompts)
    return {"n_prompts": n, "greedy_match_rate": sum(d is None for d in div) / n,
            "prefix_match": sum(prefix) / n,
            "original_nll_on_adapted": sum(nll_adapted) / n, "original_nll_on_original": sum(nll_original) / n,
            "nll_increase": (sum(nll_adapted) - sum(nll_original)) / n}


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


# A lossless mode's output may leave greedy's only where the backbone's two tokens are within this many
# rounding steps of each other (`divergence_margin`'s ulps). Measured on SmolLM2 in bf16 (2-core AVX-512
# EPYC, 20 unseen prompts): verify's and tree's 16 divergences had margins of 0 to 2.9 steps (0 to 0.375
# nats), and on 20 other prompts (seed=1) 0 to 0.6 steps; a token the backbone did not choose trails by
# nats, tens to hundreds of steps.
ROUNDING_ULPS = 8


def divergence_summary(backbone, prompts: list[list[int]], greedy: list[list[int]],
                       outputs: list[list[int]]) -> dict:
    """For a lossless mode: the margin (`divergence_margin`) at each output's first difference from
    greedy, and the differences counted by kind: `divergences` (outputs not identical), of them
    `divergences_judged` (a competing token to compare; not one output stopping earlier),
    `divergences_at_near_ties` (|ulps| <= ROUNDING_ULPS), `divergences_greedy_led` (greedy's token
    ahead by more: the mode accepted a token the backbone did not choose) and
    `divergences_mode_led` (the mode's token ahead by more: the greedy reference is the suspect);
    `max_divergence_ulps` / `_nats`: the largest margin by size, with its sign."""
    margins = [divergence_margin(backbone, p, g, o) for p, g, o in zip(prompts, greedy, outputs, strict=True)]
    return count_divergences(margins, sum(o != g for g, o in zip(greedy, outputs, strict=True)))


def count_divergences(margins: list[dict | None], differ: int) -> dict:
    """`divergence_summary`'s counts from the margins (None: identical or not judged) and the number
    of outputs that differ."""
    judged = [m for m in margins if m is not None]
    worst = max(judged, key=lambda m: abs(m["ulps"]), default={"ulps": None, "nats": None})
    return {"divergence_margins": margins,
            "max_divergence_ulps": worst["ulps"], "max_divergence_nats": worst["nats"],
            "divergences": differ, "divergences_judged": len(judged),
            "divergences_at_near_ties": sum(abs(m["ulps"]) <= ROUNDING_ULPS for m in judged),
            "divergences_greedy_led": sum(m["ulps"] > ROUNDING_ULPS for m in judged),
            "divergences_mode_led": sum(m["ulps"] < -ROUNDING_ULPS for m in judged)}


def divergence_lines(report: dict) -> list[str]:
    """One line per lossless mode whose outputs are not all greedy's, saying what kind of difference
    each is (`divergence_summary`): near-ties (rounding of multi-token forwards), tokens the backbone
    did not choose (a verification error), a greedy reference the backbone disagrees with, or an
    output that stops where the other goes on."""
    lines = []
    for name, d in report["details"].items():
        differ = d.get("divergences")
        if not differ:
            continue
        n, ties, judged = report["modes"][name]["n_prompts"], d["divergences_at_near_ties"], d["divergences_judged"]
        parts = []
        if ties:
            parts.append(f"{ties} at near-ties (within {ROUNDING_ULPS} rounding steps): rounding of multi-token "
                         f"forwards in {(report.get('decoder') or {}).get('dtype', 'this dtype')}, not a verification error "
                         "(eval.dtype=float32 avoids it)")
        if d["divergences_greedy_led"]:
            parts.append(f"{d['divergences_greedy_led']} where greedy's token led by more: this lossless mode "
                         "accepted tokens the backbone did not choose")
        if d["divergences_mode_led"]:
            parts.append(f"{d['divergences_mode_led']} where the mode's token led by more: the greedy reference "
                         "chose a token the backbone ranks lower")
        if differ > judged:
            parts.append(f"{differ - judged} where one output stops and the other goes on (not judged)")
        worst = (f"; largest margin {d['max_divergence_nats']:+.3f} nats, {d['max_divergence_ulps']:+.1f} steps"
                 if judged else "")
        lines.append(f"{name}: {differ} of {n} outputs leave greedy's: " + "; ".join(parts) + worst)
    return lines


def round_order(names: list[str], prompt_index: int, round_index: int) -> list[str]:
    """The order in which HF generate and the modes decode one prompt in one round: a rotation by
    prompt index + round index, so that no one of them always runs first (or always last)."""
    shift = (prompt_index + round_index) % len(names)
    return names[shift:] + names[:shift]


def run_modes(backbone, heads, prompts: list[list[int]], cfg, span_policies=None, sim_tau=None,
              tree_stats=None) -> dict:
    """Decode every prompt with HF generate and each mode in cfg.modes, in cfg.rounds timing rounds;
    returns the report dict and round 1's outputs per mode."""
    from tqdm.auto import tqdm

    from mtp_train.decoding import ROW_BUCKETS, Decoder

    tok = backbone.tokenizer
    eos = eos_ids(backbone.model, tok)
    dec = Decoder(backbone, heads, eos_ids=eos)
    k = dec.k
    mm = dec.measure_matmuls()
    log.info("matmul layout per weight (row buckets %s; L = F.linear, T = W @ x^T): %s",
             "/".join(map(str, ROW_BUCKETS)), mm.describe())
    plan = plan_trees(dec, tree_stats, prompts[0], cfg) if k else {}
    costs = [plan["curve"]["costs"][n + 1] for n in range(k + 1)] if k else [1.0]

    def run_mode(mode: str, prompt: list[int], max_new_tokens: int | None = None):
        opts = {}
        if mode == "relaxed":
            opts = {"delta": cfg.delta, "budget": cfg.budget}
        elif mode in ("clp", "gate", "clp+verify"):
            opts = {"span_policy": span_policies[mode]}
        elif mode in ("tree", "dynamic"):
            opts = {"tree": plan[mode]}
        elif mode == "adaptive":
            opts = {"depth_policy": adaptive_policy(plan, cfg)}
        return dec.generate(prompt, max_new_tokens or cfg.max_new_tokens, EVAL_MODES[mode], **opts)

    span_policies = span_policies or {}
    for p in prompts[: cfg.warmup]:  # warm-up: allocator, thread pools, one-time kernels
        hf_generate(backbone, p, min(16, cfg.max_new_tokens), eos)
        for mode in cfg.modes:
            run_mode(mode, p, min(16, cfg.max_new_tokens))
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
        if name in LOSSLESS_EVAL_MODES and name != "greedy":
            report["details"][name].update(divergence_summary(backbone, prompts, greedy, outs))
    report["eos"] = eos
    report["step_cost"] = costs[-1]
    report["step_costs"] = costs
    if plan:
        report["decoder"] = {"matmul_layout": mm.describe(), "dtype": str(backbone.model.dtype).replace("torch.", ""),
                             "verify_costs": _json_keys(plan["curve"]), "trees": plan["summary"]}
    report["k"] = k
    report["sim_tau"] = sim_tau
    report["rounds"] = rounds
    report["flags"] = plausibility_flags(report)
    report["divergence"] = divergence_lines(report)
    for line in report["flags"] + report["divergence"]:
        log.warning("%s", line)
    return report, outputs | {"hf_generate": hf_out}


# ---------------------------------------------------------------------------------------------------
# which trees to verify: grown from the heads' rank statistics, sized by this machine's costs


def plan_trees(dec, stats, prompt: list[int], cfg) -> dict:
    """Measure this machine's verify cost curve and drafting costs, and pick: the static tree with
    the most expected committed tokens per unit of step time (`tree`), a dynamic tree of the same
    node count (`dynamic`), the cost/acceptance Pareto front (adaptive, cost policy) and one tree per
    entropy bucket (adaptive, entropy policy: EntMTP). Without rank statistics the chain stands in
    for the static tree and the entropy policy uses chains."""
    from mtp_train.decoding import DynamicTree
    from mtp_train.trees import TreeShape, expected_accepted, grow_tree, pareto_front

    k = dec.k
    shapes = {TreeShape.chain(k).paths: TreeShape.chain(k)}
    prefix, total = (stats.prefix_counts(), stats.total()) if stats is not None and stats.total() else ({}, 0)
    budgets = [cfg.tree_nodes] if cfg.tree_nodes else list(cfg.tree_budgets)
    for b in budgets if total else []:
        shape = grow_tree(prefix, b, k)
        if shape.n:
            shapes.setdefault(shape.paths, shape)
    sizes = sorted({1, 2, 4, 8, 16, 32, 64} | set(range(1, k + 2)) | {s.n + 1 for s in shapes.values()})
    curve = dec.verify_costs(sizes=tuple(sizes))
    one = curve["one_token_ms"] / 1e3
    draft_dtypes = {}
    for dtype in dict.fromkeys((dec.draft_dtype, torch.bfloat16)):  # drafts need not be exact
        dec.set_draft_dtype(dtype)
        draft_dtypes[dtype] = dec.draft_cost(TreeShape.chain(k), prompt)
    dec.set_draft_dtype(min(draft_dtypes, key=draft_dtypes.get))
    log.info("drafting a chain of %d: %s; drafting in %s", k, ", ".join(
        f"{str(d).replace('torch.', '')} {t * 1e3:.1f} ms" for d, t in draft_dtypes.items()), dec.draft_dtype)
    rows = []
    for shape in shapes.values():
        tau = 1 + expected_accepted(shape, prefix, total) if total else None
        draft = dec.draft_cost(shape, prompt)
        cost = curve["costs"][shape.n + 1] + draft / one
        rows.append({"shape": shape, "label": shape.label(), "nodes": shape.n, "depth": shape.depth,
                     "predicted_tau": tau, "verify_cost": curve["costs"][shape.n + 1],
                     "draft_cost": draft / one, "cost": cost,
                     "rate": None if tau is None else tau / cost})
    scored = [r for r in rows if r["rate"] is not None]
    static = max(scored, key=lambda r: r["rate"])["shape"] if scored else TreeShape.chain(k)
    if cfg.tree_nodes and scored:  # a size the user asked for
        static = next((r["shape"] for r in scored if not r["shape"].is_chain), static)
    dynamic = DynamicTree(nodes=static.n, topk=cfg.dynamic_topk, width=cfg.dynamic_topk)
    empty = {"shape": TreeShape(()), "predicted_tau": 1.0, "cost": 1.0}
    cands = [empty, *scored] if scored else [empty, *({**r, "predicted_tau": 1.0 + 0.5 * r["nodes"]}
                                                      for r in rows)]
    front = pareto_front(cands)
    by_entropy = None
    if total:
        by_entropy = []
        for bucket in range(len(stats.counts)):
            pb, tb = stats.prefix_counts(bucket), stats.total(bucket)
            if tb < 30:  # too few positions to grow a tree of its own
                by_entropy.append(static)
                continue
            best, best_rate = TreeShape(()), 1.0
            for r in rows:
                shape = r["shape"] if r["shape"].is_chain else grow_tree(pb, r["nodes"], k)
                if shape.n + 1 not in curve["costs"]:
                    continue
                rate = (1 + expected_accepted(shape, pb, tb)) / (curve["costs"][shape.n + 1] + r["draft_cost"])
                if rate > best_rate:
                    best, best_rate = shape, rate
            by_entropy.append(best)
    summary = {
        "static": static.label(), "static_paths": [list(p) for p in static.paths], "dynamic": dynamic.label(),
        "candidates": [{kk: v for kk, v in r.items() if kk != "shape"} for r in rows],
        "pareto": [c["shape"].label() if c["shape"].n else "none" for c in front],
        "entropy_trees": [t.label() if t.n else "none" for t in by_entropy] if by_entropy else None,
        "entropy_edges": list(stats.edges) if total else None, "rank_positions": total,
        "draft_dtype": str(dec.draft_dtype).replace("torch.", ""),
        "draft_ms_by_dtype": {str(d).replace("torch.", ""): t * 1e3 for d, t in draft_dtypes.items()}}
    log.info("verify cost on this machine (n tokens / 1 token, one token %.1f ms): %s", curve["one_token_ms"],
             ", ".join(f"{n}: {c:.2f}" for n, c in curve["costs"].items()))
    for r in rows:
        log.info("  %-8s predicted tau %s, verify %.2f + draft %.2f = cost %.2f%s", r["label"],
                 "-" if r["predicted_tau"] is None else f"{r['predicted_tau']:.2f}", r["verify_cost"],
                 r["draft_cost"], r["cost"], "" if r["rate"] is None else f", tau/cost {r['rate']:.2f}")
    log.info("tree mode verifies %s; dynamic %s", static.label(), dynamic.label())
    return {"tree": static, "dynamic": dynamic, "curve": curve, "pareto": front, "by_entropy": by_entropy,
            "stats": stats if total else None, "summary": summary}


def adaptive_policy(plan: dict, cfg):
    """A fresh policy for one decode: the cost policy over the Pareto trees (running acceptance
    seeded by the rank statistics), or the entropy policy over the per-bucket trees."""
    from mtp_train.decoding import AcceptanceModel, CostPolicy, EntropyPolicy

    stats = plan["stats"]
    if cfg.adaptive_policy == "cost":
        model = AcceptanceModel(stats.prefix_counts(), stats.total()) if stats else AcceptanceModel()
        front = plan["pareto"]
        return CostPolicy([c["shape"] for c in front], [c["cost"] for c in front], model)
    if plan["by_entropy"]:
        return EntropyPolicy(plan["by_entropy"], stats.edges)
    return EntropyPolicy.chains(plan["tree"].depth or 1, cfg.entropy_low, cfg.entropy_high)


# ---------------------------------------------------------------------------------------------------
# the machine and the dtype


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def resolve_dtype(name: str) -> torch.dtype:
    """eval.dtype -> a torch dtype; auto = bf16 where matmuls have native bf16 (AMX, avx512_bf16, a
    GPU), float32 elsewhere. (On an AVX2 EPYC a bf16 SmolLM2 reads one token in 60 ms against 91
    in float32, but 16 tokens cost 5.9x one token against 1.7x, and multi-token bf16 forwards round
    differently from one-token ones, so verified output drifts from the bf16 greedy loop.)"""
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


def _json_keys(curve: dict) -> dict:
    """The cost curve with string keys, as it reads back from eval_report.json."""
    return {**curve, "costs": {str(n): c for n, c in curve["costs"].items()},
            "spread": {str(n): v for n, v in curve["spread"].items()}}


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
    if adapted := report.get("backbone_adapted"):
        d = adapted["drift"]
        console.print(f"verified against the LoRA-adapted backbone ({adapted['adapter']}); against the original: "
                      f"greedy answers identical {d['greedy_match_rate']:.2f}, prefix kept {d['prefix_match']:.2f}, "
                      f"the original's NLL {d['original_nll_on_adapted']:.3f} on the adapted answers vs "
                      f"{d['original_nll_on_original']:.3f} on its own", highlight=False, soft_wrap=True)
    if report.get("rounds", 1) > 1:
        console.print(f"speedup: median of {report['rounds']} timing rounds (min-max in brackets)")
    for line in report.get("flags") or []:
        console.print(f"[bold red]flag[/]: {line}", highlight=False, soft_wrap=True)
    for line in report.get("divergence") or []:
        console.print(f"[bold yellow]not identical to greedy[/]: {line}", highlight=False, soft_wrap=True)


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
    paths.append(out_dir / SPEEDUP_PNG)
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
        paths.append(out_dir / ACCEPTANCE_PNG)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    curve = (report.get("decoder") or {}).get("verify_costs")
    if curve:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        ns = sorted(int(n) for n in curve["costs"])
        cost = [curve["costs"][n] if n in curve["costs"] else curve["costs"][str(n)] for n in ns]
        spread = [curve["spread"].get(n, curve["spread"].get(str(n))) for n in ns]
        a1.errorbar(ns, cost, yerr=[[c - lo for c, (lo, _) in zip(cost, spread, strict=True)],
                                    [hi - c for c, (_, hi) in zip(cost, spread, strict=True)]],
                    fmt="o-", capsize=3)
        a1.set_xscale("log", base=2)
        a1.set_xlabel("tokens in one backbone forward")
        a1.set_ylabel("time / one token")
        a1.set_title(f"verify cost (one token {curve['one_token_ms']:.0f} ms)")
        trees = report["decoder"].get("trees") or {}
        rows = [r for r in trees.get("candidates", []) if r["predicted_tau"] is not None]
        for r in rows:
            chosen = r["label"] == trees.get("static")
            a2.scatter(r["cost"], r["predicted_tau"], color="tab:red" if chosen else "tab:blue", zorder=3)
            a2.annotate(r["label"], (r["cost"], r["predicted_tau"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        a2.set_xlabel("step cost (verify + draft) / one token")
        a2.set_ylabel("predicted tau")
        a2.set_title("candidate trees (red: chosen)")
        for ax in (a1, a2):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / VERIFY_COSTS_PNG)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def save_report(report: dict, out_dir: Path) -> Path:
    path = Path(out_dir) / EVAL_REPORT
    write_json_atomic(path, report)
    return path
