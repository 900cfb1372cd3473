"""The quality and timing signals of mtp-eval that need no judge (docs/algorithms.md, "Metrics"):
repetition, the backbone's NLL of an output, where and by how much a lossless mode's output leaves
greedy's, one mode's report entry from its decodes and timing rounds, and the bound a speedup cannot
plausibly pass. The report these fill is described in `evaluation/runner.py`.
"""

from __future__ import annotations

import statistics

import torch


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
    tau, acceptance, hist = _acceptance(results, k)
    new_tokens = sum(len(o) for o in outputs)
    tokens = list(round_tokens) if round_tokens is not None else [new_tokens] * len(secs)
    speedups = [h / s if s > 0 else 0.0 for h, s in zip(hf, secs, strict=True)]
    rates = [t / s if s > 0 else 0.0 for t, s in zip(tokens, secs, strict=True)]
    rep = {
        "tau": tau,
        "acceptance": acceptance,
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


def _acceptance(results: list, k: int) -> tuple[float, list, list[int]]:
    """From DecodeResults: tau (committed tokens per step), acceptance per depth (kept / reached,
    None where never reached) and the histogram of tokens committed per step (1..k+1)."""
    steps = sum(r.steps for r in results)
    committed = sum(sum(r.accept_lengths) for r in results)
    reached = [sum(r.reached[j] for r in results) for j in range(k)] if results else []
    accepted = [sum(r.accepted[j] for r in results) for j in range(k)] if results else []
    hist = [0] * (k + 1)
    for r in results:
        for a in r.accept_lengths:
            hist[min(a, k + 1) - 1] += 1
    return (committed / steps if steps else 1.0,
            [a / r if r else None for a, r in zip(accepted, reached, strict=True)], hist)


NOISE_Z = 4.0  # a sampled mode's NLL or repetition this many standard errors from HF's samples' is flagged


def z_score(a: list[float], b: list[float]) -> float:
    """(mean a - mean b) in standard errors of the difference (Welch); 0 for identical constants."""
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    var = (statistics.variance(a) / len(a) if len(a) > 1 else 0.0) + (statistics.variance(b) / len(b) if len(b) > 1 else 0.0)
    if var == 0:
        return 0.0 if ma == mb else float("inf") * (1 if ma > mb else -1)
    return (ma - mb) / var ** 0.5


def sampled_summary(outputs: list[list[int]], results: list, seconds: list[float], tokens: list[int],
                    hf_seconds: list[float], hf_tokens: list[int], nll: list[float], hf_nll: list[float],
                    hf_outputs: list[list[int]], k: int) -> tuple[dict, dict]:
    """One sampled mode's report entry and details (evaluation/runner.py: run_sampled), from round
    1's decodes (`results`: none for HF generate itself) and each round's wall time and new tokens.
    Samples differ from HF's, so the speedup is a ratio of tokens/s per round; NLL and repetition are
    compared with HF's samples in standard errors (`z_score`)."""
    tau, acceptance, hist = _acceptance(results, k)
    rates = [t / s if s > 0 else 0.0 for t, s in zip(tokens, seconds, strict=True)]
    hf_rates = [t / s if s > 0 else 0.0 for t, s in zip(hf_tokens, hf_seconds, strict=True)]
    speedups = [r / h if h > 0 else 0.0 for r, h in zip(rates, hf_rates, strict=True)]
    rep, hf_rep = list(map(repetition_ratio, outputs)), list(map(repetition_ratio, hf_outputs))
    entry = {"tau": tau, "acceptance": acceptance, "tokens_per_s": statistics.median(rates),
             "speedup_vs_hf": statistics.median(speedups), "repetition_ratio": statistics.fmean(rep),
             "backbone_nll": statistics.fmean(nll), "new_tokens": sum(len(o) for o in outputs)}
    details = {"wall_s_rounds": list(seconds), "speedup_rounds": speedups,
               "speedup_spread": [min(speedups), max(speedups)], "accept_hist": hist if results else None}
    if results:
        entry["nll_z_vs_hf"], entry["repetition_z_vs_hf"] = z_score(nll, hf_nll), z_score(rep, hf_rep)
        off = [f"{what} {entry[what]:.3f} is {z:+.1f} standard errors from HF's samples' {ref:.3f}"
               for what, z, ref in (("backbone_nll", entry["nll_z_vs_hf"], statistics.fmean(hf_nll)),
                                    ("repetition_ratio", entry["repetition_z_vs_hf"], statistics.fmean(hf_rep)))
               if abs(z) > NOISE_Z]
        if off:
            details["not_within_noise"] = "; ".join(off)
    return entry, details


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
# rounding steps of each other (`divergence_margin`'s ulps): bf16 near-ties sit at a few steps, a token
# the backbone did not choose trails by tens to hundreds (docs/decoding.md, "Lossless, up to rounding").
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
