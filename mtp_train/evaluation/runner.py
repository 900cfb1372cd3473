"""mtp-eval's runner: every decoding mode and HF `generate` greedy on the same prompts, in one
process, after a warm-up, in interleaved timing rounds; and the report their figures make
(`evaluation/metrics.py` computes them, `evaluation/render.py` shows and saves them).

`eval_report.json` holds, under "modes", one object per mode with exactly these keys (docs/algorithms.md,
"Metrics"): tau (committed tokens per backbone forward after the prefill), acceptance (per-depth
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

import logging
import time

import torch

from mtp_train.backbone import eos_ids
from mtp_train.evaluation.decode import decode
from mtp_train.evaluation.metrics import (
    backbone_nll,
    divergence_lines,
    divergence_summary,
    first_divergence,
    plausibility_flags,
    summarise,
)
from mtp_train.evaluation.modes import MODES
from mtp_train.evaluation.planning import adaptive_policy, plan_trees

log = logging.getLogger(__name__)


def hf_generate(backbone, prompt: list[int], max_new_tokens: int, eos: list[int], warpers=None,
                seed: int = 0) -> tuple[list[int], float]:
    """HF generate's new tokens and wall time: greedy, or with `warpers` (sampling.Warpers) sampled
    with do_sample=True and the same warpers, from the global generator seeded with `seed`."""
    from transformers import GenerationConfig

    sample = {"do_sample": False} if warpers is None else {
        "do_sample": True, "temperature": warpers.temperature, "top_k": warpers.top_k, "top_p": warpers.top_p,
        "min_p": warpers.min_p}
    gc = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos,
                          pad_token_id=backbone.tokenizer.pad_token_id or eos[0], **sample)
    ids = torch.tensor([prompt], device=backbone.device)
    if warpers is not None:
        torch.manual_seed(seed)
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


def round_order(names: list[str], prompt_index: int, round_index: int) -> list[str]:
    """The order in which HF generate and the modes decode one prompt in one round: a rotation by
    prompt index + round index, so that no one of them always runs first (or always last)."""
    shift = (prompt_index + round_index) % len(names)
    return names[shift:] + names[:shift]


# a sampled decode's seconds over the greedy decode of the same mode (or HF generate's, whichever is
# longer): fewer drafts are accepted under sampling, and the warpers and the acceptance test cost a little
SAMPLED_OVERHEAD = 1.1


def sampled_that_fit(mean_s: dict[str, float], names: list[str], decodes: int, temperatures: list[float],
                     left_s: float, tail_s: float) -> tuple[list[float], dict]:
    """The sampling temperatures to decode, in their order, while their predicted seconds and the
    evaluation's tail (`tail_s`) fit in `left_s`: each temperature decodes `decodes` prompt-samples
    with every one of `names`, priced from the greedy decodes just measured (`mean_s`, seconds a
    decode per name: a sampled one costs SAMPLED_OVERHEAD x the longer of its mode's and HF's)."""
    hf = mean_s["hf_generate"]
    fallback = max(mean_s.values())
    one = sum(max(mean_s.get(n, fallback), hf) for n in names) * decodes * SAMPLED_OVERHEAD
    keep = [t for i, t in enumerate(temperatures) if (i + 1) * one + tail_s <= left_s]
    return keep, {"left_s": round(left_s, 1), "per_temperature_s": round(one, 1), "tail_s": round(tail_s, 1),
                  "cut": [t for t in temperatures if t not in keep]}


QUICK_PROBE_ROUNDS = 3  # the layout, cost-curve and drafting timing rounds when a deadline has shortened the decodes


def run_modes(backbone, heads, prompts: list[list[int]], cfg, span_policies=None, sim_tau=None,
              tree_stats=None, deadline: float | None = None, quick_probes: bool = False) -> dict:
    """Decode every prompt with HF generate and each mode in cfg.modes, in cfg.rounds timing rounds;
    returns the report dict and round 1's outputs per mode. With a `deadline` (Unix seconds), the
    sampled runs are decoded only while the greedy decodes' measured time says they fit before it
    (report["sampled_fit"] says what was cut). quick_probes: the matmul layouts, the verify cost
    curve and the drafting costs are timed in QUICK_PROBE_ROUNDS rounds instead of 6, 7 and 5 (the
    layouts above 16 rows in 2 instead of 3), for a deadline that shortened the decodes: on a 3x
    slower machine the full probes took about 3 minutes, as long as the decodes themselves."""
    from tqdm.auto import tqdm

    from mtp_train.decoding import ROW_BUCKETS, Decoder
    from mtp_train.decoding.costs import measure_matmuls

    tok = backbone.tokenizer
    eos = eos_ids(backbone.model, tok)
    dec = Decoder(backbone, heads, eos_ids=eos)
    k = dec.k
    mm = measure_matmuls(dec, **({"reps": QUICK_PROBE_ROUNDS} if quick_probes else {}))
    log.info("matmul layout per weight (row buckets %s; L = F.linear, T = W @ x^T, P = packed): %s",
             "/".join(map(str, ROW_BUCKETS)), mm.describe())
    curve_rounds = {"rounds": QUICK_PROBE_ROUNDS, "draft_rounds": QUICK_PROBE_ROUNDS} if quick_probes else {}
    plan = plan_trees(dec, tree_stats, prompts[0], cfg, **curve_rounds) if k else {}
    costs = [plan["curve"]["costs"][n + 1] for n in range(k + 1)] if k else [1.0]

    def run_mode(name: str, prompt: list[int], max_new_tokens: int | None = None, warpers=None, seed: int = 0):
        m = MODES[name]  # the record takes the options its parts read
        opts = {"delta": cfg.delta, "budget": cfg.budget, "tree": plan.get(m.drafts),
                "span_policy": span_policies.get(name)}
        if warpers is not None:
            opts.update(warpers=warpers, generator=torch.Generator().manual_seed(seed), vocab=dec.weight.shape[0])
        if m.drafts == "adaptive":  # a policy learns as it decodes: a fresh one per prompt
            opts["depth_policy"] = adaptive_policy(plan, cfg)
        return decode(dec, prompt, max_new_tokens or cfg.max_new_tokens, name, **opts)

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
        if MODES[name].lossless and name not in ("greedy", "hf_generate"):
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
    temperatures = cfg.sampling.temperatures_sampled
    if temperatures and deadline is not None:
        mean_s = {n: sum(wall[n]) / (rounds * len(prompts)) for n in names}
        # after the sampled runs: HF generate in both dtypes on 3 prompts x 32 tokens (float32 up to 2x
        # slower), the plots and the report
        tail_s = 2 * 3 * 2 * mean_s["hf_generate"] * min(1.0, 32 / cfg.max_new_tokens) + 10
        temperatures, report["sampled_fit"] = sampled_that_fit(
            mean_s, ["hf_generate", *cfg.sampled_modes()], len(prompts) * cfg.sampling.samples * rounds,
            temperatures, deadline - time.time(), tail_s)
        if report["sampled_fit"]["cut"]:
            log.warning("budget.deadline: %.1f min left; a sampled run is predicted %.1f min from the greedy decodes' "
                        "time: cut the sampled runs at T=%s", report["sampled_fit"]["left_s"] / 60,
                        report["sampled_fit"]["per_temperature_s"] / 60, report["sampled_fit"]["cut"])
    if temperatures:
        report["sampled"] = run_sampled(backbone, prompts, cfg, run_mode, eos, k, temperatures)
        report["flags"] += [line for run in report["sampled"].values() for line in run["flags"]]
    for line in report["flags"] + report["divergence"]:
        log.warning("%s", line)
    return report, outputs | {"hf_generate": hf_out}



def sample_seed(base: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample j of prompt i (the same at every temperature, in every round and mode)."""
    return base * 1_000_003 + prompt_index * 1_009 + sample_index


def run_sampled(backbone, prompts: list[list[int]], cfg, run_mode, eos: list[int], k: int,
                temperatures: list[float] | None = None) -> dict:
    """eval.sampling: at each temperature > 0 (or each of `temperatures`), HF generate(do_sample=True) and every sampled mode on
    eval.sampling.samples seeded samples of every prompt, interleaved and rotated as the greedy
    rounds are. Returns {"t<T>": run}: a run holds its temperature, warpers and samples, "modes" (per
    mode: tau, acceptance, tokens_per_s, speedup_vs_hf, repetition_ratio, backbone_nll, the
    temperature and warpers, n_prompts, samples_per_prompt, new_tokens, and for our modes nll_z_vs_hf
    / repetition_z_vs_hf: how many standard errors the mode's mean is from HF's samples'), "details"
    and "flags" (a mode whose NLL or repetition is not within noise of HF's). Outputs differ from HF's
    sample by sample (different draws), so speedup_vs_hf is a ratio of tokens/s, not of wall time."""
    from tqdm.auto import tqdm

    from mtp_train.decoding.sampling import Warpers
    from mtp_train.evaluation.metrics import sampled_summary

    s = cfg.sampling
    modes = cfg.sampled_modes()
    names = ["hf_generate", *modes]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(s.samples)]
    rounds = getattr(cfg, "rounds", 1)
    out = {}
    for temperature in s.temperatures_sampled if temperatures is None else temperatures:
        w = Warpers(temperature=temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
        for name in modes:  # warm-up: the sampling code paths once
            run_mode(name, prompts[0], min(16, cfg.max_new_tokens), warpers=w)
        first = {n: [] for n in names}
        wall = {n: [0.0] * rounds for n in names}
        new_tokens = {n: [0] * rounds for n in names}
        bar = tqdm(total=rounds * len(jobs) * len(names), desc=f"decode T={temperature}", unit="run",
                   dynamic_ncols=True)
        for r in range(rounds):
            for n_job, (i, j) in enumerate(jobs):
                seed = sample_seed(s.seed, i, j)
                for name in round_order(names, n_job, r):
                    t0 = time.perf_counter()
                    if name == "hf_generate":
                        res, _ = hf_generate(backbone, prompts[i], cfg.max_new_tokens, eos, warpers=w, seed=seed)
                        toks = res
                    else:
                        res = run_mode(name, prompts[i], warpers=w, seed=seed)
                        toks = res.tokens
                    wall[name][r] += time.perf_counter() - t0
                    new_tokens[name][r] += len(toks)
                    if r == 0:
                        first[name].append(res)
                    bar.update(1)
        bar.close()
        sample_prompts = [prompts[i] for i, _ in jobs]
        hf_out = first["hf_generate"]
        nll = {n: [backbone_nll(backbone, p, o) for p, o in
                   zip(sample_prompts, hf_out if n == "hf_generate" else [x.tokens for x in first[n]], strict=True)]
               for n in names}
        warpers = {"temperature": temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p}
        run = {**warpers, "warpers": warpers, "samples_per_prompt": s.samples, "seed": s.seed, "modes": {},
               "details": {}, "flags": []}
        for name in names:
            outs = hf_out if name == "hf_generate" else [x.tokens for x in first[name]]
            results = [] if name == "hf_generate" else first[name]
            entry, details = sampled_summary(
                outs, results, wall[name], new_tokens[name], wall["hf_generate"], new_tokens["hf_generate"],
                nll[name], nll["hf_generate"], hf_out, k)
            entry.update(warpers, n_prompts=len(prompts), samples_per_prompt=s.samples)
            run["modes"][name], run["details"][name] = entry, details
            if details.get("not_within_noise"):
                run["flags"].append(f"{name} at T={temperature}: {details['not_within_noise']}")
        out[f"t{temperature}"] = run
    return out


def _json_keys(curve: dict) -> dict:
    """The cost curve with string keys, as it reads back from eval_report.json."""
    return {**curve, **{key: {str(n): v for n, v in curve[key].items()}
                        for key in ("costs", "raw", "spread") if key in curve}}
