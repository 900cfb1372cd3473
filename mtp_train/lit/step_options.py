"""Training-step options timed where the code runs, and trainer.precision=auto chosen by them.

An option is a name made of parts joined by "+": `fp32`, `bf16` (autocast to bfloat16, what
Lightning's bf16-mixed does on a CPU), `compile` (torch.compile of the heads' forward) and
`alpha-all` (the training metric train/alpha_d* on every position, as before it was estimated on
every TRAIN_ALPHA_STRIDE-th: for the bench's side by side only). Each
option gets its own copy of the same initial heads and its own AdamW, runs one untimed step first
(for compile: the compile), then whole steps (forward, loss, backward, optimizer) over the same
batches, in a rotating order per round, so that a machine that speeds up or slows down favours
none. bench/step_options.py prints the table; mtp-train with trainer.precision=auto runs the fp32
and bf16 options on its first batches and trains in the faster; with train.compile=auto it then times
that precision compiled against eager and keeps the faster. Where both are auto and the CPU has native
bf16, choose_jointly times fp32, bf16 and bf16 compiled in one pass instead: bf16 can pay only
compiled (docs/training.md, "Faster steps").
"""

from __future__ import annotations

import copy
import logging
import statistics
import time

import torch

log = logging.getLogger(__name__)

# a bf16 step must be at least this much faster to be chosen: bf16 rounds the heads' activations,
# so a tie goes to float32
AUTO_MIN_GAIN = 1.1
# a compiled step must be at least this much faster to be kept (training compiles the heads once more,
# mostly from Inductor's caches)
COMPILE_MIN_GAIN = 1.05
# train.compile=auto times nothing for a run planned shorter than this: the compile (30-40 s on a
# 2-core EPYC, about 3x that on a first-generation Zen) and its timing would not be paid back
COMPILE_MIN_SECONDS = 300.0


def time_options(backbone, heads, loss_cfg, train_cfg, batches: list[dict], options: list[str],
                 rounds: int = 2) -> dict:
    """{option: {"first_s": the untimed first step, "round_s": [seconds of the timed steps, per round]}}."""
    from mtp_train.lit.module import TRAIN_ALPHA_STRIDE, MTPHeadsModule

    setups = {}
    for name in options:
        parts = set(name.split("+"))
        own = copy.deepcopy(heads)
        module = MTPHeadsModule(backbone, own, loss_cfg, train_cfg,
                                train_alpha_stride=1 if "alpha-all" in parts else TRAIN_ALPHA_STRIDE)
        module.log = lambda *a, **k: None  # no trainer here: nothing is logged
        if "compile" in parts:
            own.compile(dynamic=True)  # in place, as training compiles: the same state dict keys
        setups[name] = (module, torch.optim.AdamW(own.parameters(), lr=train_cfg.lr), "bf16" in parts)

    def step(name: str, batch: dict) -> float:
        module, opt, bf16 = setups[name]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = module.model_step(batch, "train")
        opt.zero_grad()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    with torch.random.fork_rng(devices=[]):  # CPU steps draw (train.feature_noise): training's own draws stay the same
        out = {name: {"first_s": step(name, batches[0]), "round_s": []} for name in options}
        for r in range(rounds):
            shift = r % len(options)
            for name in options[shift:] + options[:shift]:
                out[name]["round_s"].append(sum(step(name, b) for b in batches[1:]))
    return out


def _seconds_a_step(timed: dict, batches: list[dict]) -> dict[str, float]:
    """time_options' rounds as the median seconds of one timed step, per option."""
    return {n: statistics.median(v["round_s"]) / (len(batches) - 1) for n, v in timed.items()}


def _compile_failure(err: Exception) -> str:
    """The record's `why` for a compile that failed (its first line), logged as training eager."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    log.warning("train.compile=auto: torch.compile failed here (%s: %s); training eager", type(err).__name__, first)
    return f"torch.compile failed: {type(err).__name__}: {first}"


def choose_precision(backbone, heads, loss_cfg, train_cfg, batches: list[dict], rounds: int = 2) -> tuple[str, dict]:
    """trainer.precision=auto: "bf16-mixed" where the CPU multiplies bf16 natively and a bf16 step
    is at least AUTO_MIN_GAIN faster than a float32 one on these batches, else "32-true"; with the
    timings (median seconds a step) it was chosen by."""
    from mtp_train.backbone import cpu_has_native_bf16
    from mtp_train.evaluation.machine import cpu_model

    record = {"cpu": cpu_model(), "native_bf16": cpu_has_native_bf16()}
    if not record["native_bf16"]:
        return "32-true", {**record, "why": "no native bf16 on this CPU"}
    sec = _seconds_a_step(time_options(backbone, heads, loss_cfg, train_cfg, batches, ["fp32", "bf16"], rounds),
                          batches)
    gain = sec["fp32"] / sec["bf16"]
    choice = "bf16-mixed" if gain >= AUTO_MIN_GAIN else "32-true"
    record.update(step_s={n: round(v, 4) for n, v in sec.items()}, bf16_gain=round(gain, 3))
    log.info("trainer.precision=auto on %s: float32 %.3f s a step, bf16 %.3f s (%.2fx) -> %s", record["cpu"],
             sec["fp32"], sec["bf16"], gain, choice)
    return choice, record


def choose_compile(backbone, heads, loss_cfg, train_cfg, batches: list[dict], precision: str,
                   rounds: int = 2) -> tuple[bool, dict]:
    """train.compile=auto: whether the heads' forward trains faster compiled, in the precision
    training runs in, timed on these batches; with the timings. A compile that fails (no C++
    compiler, an operator Inductor cannot lower) is eager with the error recorded, not a failed run."""
    from mtp_train.evaluation.machine import cpu_model

    base = "bf16" if str(precision).startswith("bf16") else "fp32"
    record = {"cpu": cpu_model(), "precision": base}
    try:
        t = time_options(backbone, heads, loss_cfg, train_cfg, batches, [base, f"{base}+compile"], rounds)
    except Exception as err:  # noqa: BLE001 - any compiler failure means: train eager
        return False, {**record, "why": _compile_failure(err)}
    sec = _seconds_a_step(t, batches)
    gain = sec[base] / sec[f"{base}+compile"]
    choice = gain >= COMPILE_MIN_GAIN
    record.update(step_s={n: round(v, 4) for n, v in sec.items()}, compile_gain=round(gain, 3),
                  compile_s=round(t[f"{base}+compile"]["first_s"], 1))
    log.info("train.compile=auto on %s: eager %.3f s a step, compiled %.3f s (%.2fx; the compile took %.0f s) -> %s",
             record["cpu"], sec[base], sec[f"{base}+compile"], gain, record["compile_s"],
             "compiled" if choice else "eager")
    return choice, record


def choose_jointly(backbone, heads, loss_cfg, train_cfg, batches: list[dict],
                   rounds: int = 2) -> tuple[str, bool | None, dict, dict]:
    """trainer.precision=auto with train.compile=auto on a CPU with native bf16: float32, bf16 and
    bf16 compiled timed in one pass (one compile), since eager bf16 can be no faster than float32
    where compiled bf16 is the fastest of all (the AMX Xeon in docs/training.md). Returns the
    precision, whether to compile (None: float32 won, and float32 compiled is still to be timed, as
    choose_compile does), and the precision's and compile's records. bf16 must beat float32 by
    AUTO_MIN_GAIN, and compiled beat eager bf16 by COMPILE_MIN_GAIN; a compile that fails leaves the
    eager pair to decide."""
    from mtp_train.evaluation.machine import cpu_model

    cpu = cpu_model()
    try:
        t = time_options(backbone, heads, loss_cfg, train_cfg, batches, ["fp32", "bf16", "bf16+compile"], rounds)
    except Exception as err:  # noqa: BLE001 - any compiler failure means: train eager
        why = _compile_failure(err)
        precision, record = choose_precision(backbone, heads, loss_cfg, train_cfg, batches, rounds)
        return precision, False, record, {"cpu": cpu, "why": why}
    sec = _seconds_a_step(t, batches)
    step_s = {n: round(v, 4) for n, v in sec.items()}
    bf16_gain, compile_gain = sec["fp32"] / sec["bf16"], sec["bf16"] / sec["bf16+compile"]
    compiled_vs_fp32 = sec["fp32"] / sec["bf16+compile"]
    if compiled_vs_fp32 >= AUTO_MIN_GAIN and compile_gain >= COMPILE_MIN_GAIN:
        precision, compiled = "bf16-mixed", True
    elif bf16_gain >= AUTO_MIN_GAIN:
        precision, compiled = "bf16-mixed", False
    else:
        precision, compiled = "32-true", None
    p_record = {"cpu": cpu, "native_bf16": True, "step_s": step_s, "bf16_gain": round(bf16_gain, 3),
                "bf16_compiled_gain": round(compiled_vs_fp32, 3), "timed_with": "train.compile=auto"}
    c_record = {"cpu": cpu, "precision": "bf16", "step_s": step_s, "compile_gain": round(compile_gain, 3),
                "compile_s": round(t["bf16+compile"]["first_s"], 1)}
    log.info("trainer.precision=auto, train.compile=auto on %s: float32 %.3f s a step, bf16 %.3f s (%.2fx), "
             "bf16 compiled %.3f s (%.2fx; the compile took %.0f s) -> %s%s", cpu, sec["fp32"], sec["bf16"], bf16_gain,
             sec["bf16+compile"], compiled_vs_fp32, c_record["compile_s"], precision,
             {True: ", compiled", False: ", eager", None: " (float32 compiled timed next)"}[compiled])
    return precision, compiled, p_record, c_record
