"""A pipeline's deadline (budget.deadline, set by `make demo`) turned into minutes of training.

The stages before training (preparation, distillation, the cache) have run when mtp-train starts;
the ones after it (budget.after_train: mtp-clp's calibration decodes, mtp-eval's decodes) have not.
Their cost is predicted from the rate that dominates them, measured here on this machine: HF
generate's time for the backbone in the dtype evaluation decodes in, split into the prompt's
prefill and the seconds per new token (`Rate`; one generate of 1 token and one of 1 + n). Training
gets what is left: deadline - now - predicted(after) - budget.margin_min.

The prediction counts decodes of eval.max_new_tokens tokens (HF generate and every mode, greedy and
under each sampling temperature, per prompt and round; calibration's decodes per threshold) and
prices each at one prefill plus its new tokens at HF generate's rate, times DECODE_OVERHEAD
(drafting, verifying several positions at once, the cost-curve and dtype probes), plus
STAGE_FIXED_S per stage (start-up, loading the backbone) scaled by how slow this machine is
against the one it was fitted on. Dividing one generate's time by its new tokens instead counts
the prefill as if every token paid it: with a 192-token probe and 24 tokens that priced the demo's
clp + eval at 13.4 min where they had taken 5-6 (AMX Xeon, 2026-12-06).
docs/training.md ("A demo sized by its deadline") has the prediction against what the stages took.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import NamedTuple

from mtp_train.config import Config

log = logging.getLogger(__name__)

# a decode's seconds over HF generate's, the probes, cost curves and the clp stage's fit included (the
# drafting modes decode faster than HF generate, which pays for part of them). Fitted on make demo
# (2026-12-06, AMX Xeon, 20 prompts x (HF + 3 modes + 3 sampled) + 12 calibration decodes of 48
# tokens): clp + eval took 8.5 min; the probe, in a quiet training process, reads a 0.22 s prefill of
# 192 tokens and 0.048 s a token, which at 1.2 predicts 8.6
DECODE_OVERHEAD = 1.2
# the probe prompt training prices the later decodes with: HF generate's seconds per token include its
# prefill, and the evaluation's prompts (unseen ShareGPT turns under the chat template) run to a few
# hundred tokens. A 64-token probe read 24.2 tokens/s where the evaluation's own probe, on its first
# prompt (~330 tokens), read 14.2 (AMX Xeon, 2026-12-06): the reserve was 1.7 times too small
PROBE_PROMPT_TOKENS = 192
STAGE_FIXED_S = 25.0  # start-up and loading per stage at REFERENCE_TOKEN_S
REFERENCE_TOKEN_S = 0.05  # HF generate's seconds per token (SmolLM2-135M, bf16, AMX Xeon)


def decoded_kinds(cfg: Config) -> list[str]:
    """The span predictors (clp.kinds) whose modes eval.modes decodes: the ones mtp-clp calibrates
    under a deadline (a threshold no decode reads is minutes the evaluation can use)."""
    from mtp_train.evaluation.modes import MODES

    return [k for k in cfg.clp.kinds if any(MODES[m].predictor == k for m in cfg.eval.modes)]


def calibration_decodes(cfg: Config, kinds: list[str]) -> int:
    """mtp-clp's calibration decodes of eval.max_new_tokens for `kinds` that the deadline must leave
    room for: one greedy reference per prompt, shared, and per kind one decode per prompt for each
    threshold; for the first threshold only where the sweep stops at a failure (clp.stop_at_failure):
    that one decides whether any passes, and the further ones are decoded while the deadline leaves
    the time (`calibration_room`). The demo's first threshold has failed in every run since the
    bounds were tested with their noise, and the reserve for the rest went unused."""
    if not kinds:
        return 0
    per_kind = 1 if cfg.clp.stop_at_failure else len(cfg.clp.thresholds)
    return cfg.clp.calib_prompts * (1 + per_kind * len(kinds))


def decodes_after_train(cfg: Config) -> dict[str, int]:
    """How many decodes of eval.max_new_tokens each later stage runs."""
    out = {}
    e = cfg.eval
    if "clp" in cfg.budget.after_train:
        out["clp"] = calibration_decodes(cfg, decoded_kinds(cfg))
    if "eval" in cfg.budget.after_train:
        modes = 1 + len(e.modes)  # HF generate + each mode
        sampled = (1 + len(e.sampled_modes())) * len(e.sampling.temperatures_sampled) * e.sampling.samples
        out["eval"] = e.n_prompts * (modes + sampled) * e.rounds + 4  # + HF in the other dtype (3 x 32 tokens, twice)
    return out


class Rate(NamedTuple):
    """HF generate on this machine: seconds for the probe prompt's prefill (with its first new
    token) and seconds per new token after it; `prompt_tokens`: the probe prompt's length."""

    prefill_s: float
    token_s: float
    prompt_tokens: int | None = None

    def for_prompt(self, tokens: int) -> Rate:
        """The rate for a prompt of `tokens` tokens: the prefill taken as linear in the prompt's
        length between one token (one new token's time) and the probe prompt's measured prefill.
        The evaluation's prompts are not the probe's: on the AVX2 EPYC (family 25 model 1, float32)
        training's 192-token probe read a 0.50 s prefill where mtp-eval's own probe, on its typical
        prompt (47 tokens), read 0.14."""
        if not self.prompt_tokens or tokens == self.prompt_tokens:
            return self
        slope = (self.prefill_s - self.token_s) / max(1, self.prompt_tokens - 1)
        return Rate(max(self.token_s, self.token_s + slope * (tokens - 1)), self.token_s, tokens)

    def decode_s(self, new_tokens: int) -> float:
        return self.prefill_s + max(0, new_tokens - 1) * self.token_s


def decode_rate(backbone, prompt: list[int], dtype, n_tokens: int = 24) -> Rate:
    """HF generate's `Rate` for this backbone in `dtype` on this machine (a copy in that dtype when
    it differs; greedy, no end of sequence; best of three of 1 and of 1 + n_tokens new tokens, after a
    warm-up: the same probe has read 2x slower once in a busy process, and best-of keeps such noise out)."""
    import torch

    from mtp_train.evaluation.runner import hf_generate

    b = backbone
    if backbone.model.dtype != dtype:
        b = copy.copy(backbone)
        b.model = copy.deepcopy(backbone.model).to(dtype)
    with torch.no_grad():
        hf_generate(b, prompt, 1 + n_tokens, [])  # warm-up at the lengths timed
        first = min(hf_generate(b, prompt, 1, [])[1] for _ in range(3))
        more = min(hf_generate(b, prompt, 1 + n_tokens, [])[1] for _ in range(3))
    token_s = max(more - first, 1e-6) / n_tokens
    return Rate(prefill_s=first, token_s=token_s, prompt_tokens=len(prompt))


def predict_after_train(cfg: Config, rate: Rate) -> dict:
    decodes = decodes_after_train(cfg)
    slow = max(1.0, rate.token_s / REFERENCE_TOKEN_S)
    one = rate.decode_s(cfg.eval.max_new_tokens)
    seconds = {s: n * one * DECODE_OVERHEAD + STAGE_FIXED_S * slow for s, n in decodes.items()}
    return {"token_s": round(rate.token_s, 5), "prefill_s": round(rate.prefill_s, 4),
            "prompt_tokens": rate.prompt_tokens, "decodes": decodes,
            "seconds": {s: round(v, 1) for s, v in seconds.items()}, "total_s": round(sum(seconds.values()), 1)}


DEADLINE_WINDOW_H = 24  # a deadline further than this from now (either way) is not one this job can mean


def check_deadline(deadline: float, now: float | None = None) -> None:
    """Refuse a budget.deadline that no run could mean: more than DEADLINE_WINDOW_H hours before or
    after now (a typo, milliseconds, a stale value). One just passed is kept: the stages then do
    their floors (train.min_steps, the evaluation's shortest form)."""
    from mtp_train.errors import ConfigError

    now = time.time() if now is None else now
    hours = (deadline - now) / 3600
    if abs(hours) > DEADLINE_WINDOW_H:
        raise ConfigError(f"budget.deadline: {deadline} is {abs(hours):,.1f} h in the {'past' if hours < 0 else 'future'}; "
                          "it is the Unix time in seconds the job must end by (make demo passes $(date +%s) + "
                          "its minutes x 60)")


def without_sampled(cfg: Config) -> Config:
    """cfg with the evaluation's sampled runs left out (its greedy decodes only)."""
    import dataclasses

    s = cfg.eval.sampling
    sampling = dataclasses.replace(s, temperatures=[t for t in s.temperatures if t == 0], modes=None)
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, sampling=sampling))


def deadline_training_seconds(cfg: Config, backbone, prompt: list[int], now: float | None = None) -> tuple[float, dict]:
    """(seconds training may take, the record of how they were found) under budget.deadline."""
    from mtp_train.evaluation.machine import cpu_model, resolve_dtype

    check_deadline(cfg.budget.deadline, now)
    t0 = time.time()
    dtype = resolve_dtype(cfg.eval.dtype)
    rate = decode_rate(backbone, prompt, dtype)
    after = predict_after_train(cfg, rate)
    now = time.time() if now is None else now
    left = cfg.budget.deadline - now
    seconds = left - after["total_s"] - 60 * cfg.budget.margin_min
    first = 60 * cfg.budget.train_first_min
    unreserved = None
    if seconds < first and "eval" in cfg.budget.after_train and (hot := cfg.eval.sampling.temperatures_sampled):
        # training's first minutes come before the sampled runs: price the evaluation without them
        greedy = predict_after_train(without_sampled(cfg), rate)
        seconds_greedy = left - greedy["total_s"] - 60 * cfg.budget.margin_min
        unreserved = {"temperatures": hot, "training_with_s": round(max(0.0, seconds), 1),
                      "sampled_s": round(after["total_s"] - greedy["total_s"], 1)}
        log.info("budget.deadline: reserving the sampled runs (T=%s, %.1f min) would leave training %.1f min, fewer "
                 "than budget.train_first_min=%g: they are not reserved (mtp-eval runs them if its greedy decodes "
                 "leave time)", hot, unreserved["sampled_s"] / 60, max(0.0, seconds) / 60, cfg.budget.train_first_min)
        after, seconds = greedy, max(seconds, min(seconds_greedy, first))
    record = {"deadline": cfg.budget.deadline, "left_s": round(left, 1), "after_train": after,
              "margin_s": 60 * cfg.budget.margin_min, "training_s": round(max(0.0, seconds), 1),
              "cpu": cpu_model(), "probe_s": round(now - t0, 1), "dtype": str(dtype).replace("torch.", "")}
    if unreserved is not None:
        record["sampled_unreserved"] = unreserved
    log.info("deadline in %.1f min; after training %s predicted to take %.1f min (HF generate %.1f tok/s after a "
             "%.2f s prefill of %d tokens in %s on %s): %.1f min for training", left / 60,
             "+".join(after["decodes"]) or "nothing", after["total_s"] / 60, 1 / after["token_s"], after["prefill_s"],
             len(prompt), record["dtype"], record["cpu"], max(0.0, seconds) / 60)
    return max(0.0, seconds), record


def keeps_span_modes_in(cfg: Config, rate: Rate, seconds: float) -> bool:
    """Whether mtp-eval, sized (`size_eval`) into `seconds`, keeps every span-predictor mode it asks for."""
    return set(decoded_kinds(size_eval(cfg, rate, seconds, defer_sampled=True)[0])) == set(decoded_kinds(cfg))


def calibration_seconds(cfg: Config, decodes: int, rate: Rate) -> float:
    """The predicted time of `decodes` calibration decodes of eval.max_new_tokens at `rate`."""
    return decodes * rate.decode_s(cfg.eval.max_new_tokens) * DECODE_OVERHEAD


def calibration_room(cfg: Config, rate: Rate, calibration_rate: Rate | None = None, clock=time.time):
    """budget.deadline: f(decodes) -> whether `decodes` more calibration decodes, started now, leave
    the evaluation its span modes (as `kinds_to_calibrate` decides at the start); mtp-clp asks it
    before each threshold after the first (clp.stop_at_failure)."""
    def room(decodes: int) -> bool:
        left = cfg.budget.deadline - clock() - 60 * cfg.budget.margin_min
        return keeps_span_modes_in(cfg, rate, left - calibration_seconds(cfg, decodes, calibration_rate or rate))
    return room


def kinds_to_calibrate(cfg: Config, rate: Rate, left_s: float, pending: list[str] | None = None,
                       calibration_rate: Rate | None = None) -> tuple[list[str], dict[str, str]]:
    """budget.deadline: which of the `pending` span predictors (default: clp.kinds) mtp-clp
    calibrates with `left_s` seconds to the deadline, and why each other pending one is not. Only
    those whose mode eval.modes decodes, and none where the evaluation, sized as mtp-eval will size
    it (`size_eval`) in the time their calibration leaves, would cut those modes: their decodes
    would be spent on a threshold nothing reads. `rate` prices the evaluation's decodes,
    `calibration_rate` (default `rate`) the calibration's, which decode other prompts."""
    pending = list(cfg.clp.kinds) if pending is None else pending
    decoded = decoded_kinds(cfg)
    kinds = [k for k in decoded if k in pending]
    why = {k: f"eval.modes {list(cfg.eval.modes)} decodes no mode of it" for k in pending if k not in decoded}
    if not kinds:
        return [], why

    seconds = calibration_seconds(cfg, calibration_decodes(cfg, kinds), calibration_rate or rate)
    if not keeps_span_modes_in(cfg, rate, left_s):
        cut = f"with {left_s / 60:.1f} min left the evaluation cuts their modes whatever calibration takes"
    elif not keeps_span_modes_in(cfg, rate, left_s - seconds):
        cut = (f"calibrating {kinds} ({seconds / 60:.1f} min predicted) would leave the evaluation "
               f"{(left_s - seconds) / 60:.1f} min, in which it cuts their modes")
    else:
        return kinds, why
    return [], {**why, **dict.fromkeys(kinds, cut)}


MIN_EVAL_TOKENS = 16  # sizing never shortens the decodes below this many new tokens
LOSSLESS_CORE = ("verify", "tree")  # the modes sizing keeps to the last


def eval_seconds(cfg: Config, rate: Rate) -> float:
    """mtp-eval's predicted seconds under cfg.eval (the same pricing as the training reserve)."""
    import dataclasses

    only = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, after_train=["eval"]))
    return predict_after_train(only, rate)["total_s"]


def eval_slack_s(cfg: Config) -> float:
    """Seconds of budget.margin_min an evaluation's greedy decodes may be priced into before sizing
    cuts a mode or shortens them: half the margin. The price is a probe's: run K of make demo (AVX2
    EPYC) priced the evaluation with its calibrated clp mode 8 s over the 5.7 min left and cut the
    mode; the 60 decodes it kept took 4.3 min, so the 20 it cut would have fit."""
    return 30.0 * cfg.budget.margin_min


def greedy_overrun_s(cfg: Config, rate: Rate, left_s: float) -> float:
    """Seconds by which the evaluation's greedy decodes (its sampled runs left out) are priced past
    `left_s` plus `eval_slack_s`: the test `size_eval` sizes to, and what it reports when even its
    floor overruns."""
    return eval_seconds(without_sampled(cfg), rate) - left_s - eval_slack_s(cfg)


def size_eval(cfg: Config, rate: Rate, left_s: float, defer_sampled: bool = False) -> tuple[Config, list[str]]:
    """cfg with eval.* cut until mtp-eval's predicted time fits `left_s`, and what was cut, in this
    order: the sampled runs (eval.sampling.temperatures), the modes other than verify and tree, then
    eval.max_new_tokens down to MIN_EVAL_TOKENS. It fits when priced within `left_s` plus
    `eval_slack_s` (half the margin: the price is a probe's, and a mode is worth more than seconds). The prompts are never cut (20 is what makes its
    figures stable). If even that does not fit, it runs so and says by how much it will overrun.
    defer_sampled: where the greedy part fits as asked, the sampled runs stay, for the evaluation to
    decide from its greedy decodes' measured time (evaluation/runner.py, sampled_that_fit): the
    prediction is a probe's, the greedy decodes are the evaluation itself."""
    import dataclasses

    e, cuts = cfg.eval, []

    budget_s = left_s + eval_slack_s(cfg)

    def fits(c: Config) -> bool:
        return eval_seconds(c, rate) <= budget_s

    def with_eval(**kw) -> Config:
        return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, **kw))

    if not fits(cfg) and e.sampling.temperatures_sampled:
        greedy = without_sampled(cfg)
        if defer_sampled and fits(greedy):
            return cfg, cuts
        cfg = greedy
        cuts.append(f"sampled runs at T={e.sampling.temperatures_sampled}")
    core = [m for m in cfg.eval.modes if m in LOSSLESS_CORE]
    if not fits(cfg) and core and core != list(cfg.eval.modes):
        cuts.append(f"modes {[m for m in cfg.eval.modes if m not in core]}")
        # by here no sampled run is left (cut above, or none asked), so resetting eval.sampling.modes to
        # None widens nothing; it keeps the configuration valid (a list may name a mode just cut)
        cfg = with_eval(modes=core, sampling=dataclasses.replace(cfg.eval.sampling, modes=None))
    if not fits(cfg):
        n = cfg.eval.max_new_tokens
        while n > MIN_EVAL_TOKENS and not fits(with_eval(max_new_tokens=n)):
            n = max(MIN_EVAL_TOKENS, int(n * 0.8))
        if n != cfg.eval.max_new_tokens:
            cuts.append(f"max_new_tokens {cfg.eval.max_new_tokens} -> {n}")
            cfg = with_eval(max_new_tokens=n)
    if (over := greedy_overrun_s(cfg, rate, left_s)) > 0:  # by here no sampled run is left, or they fit
        cuts.append(f"still {over / 60:.1f} min over the deadline")
    return cfg, cuts
