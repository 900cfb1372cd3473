"""Training to a time budget: the learning-rate schedule whose length a plan revises (held to
transformers' own schedules), the plan made from measured step times (a fake clock), its state
through a checkpoint, and mtp-train under train.time_budget_min and under a pipeline deadline."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from mtp_train.errors import ConfigError
from tests.helpers import run_train

FAST = ["debug=smoke"]


@pytest.mark.parametrize("kind", ["cosine", "constant", "wsd"])
@pytest.mark.parametrize("total,warm", [(100, 10), (7, 3), (5, 20), (1, 0)])
def test_lr_shape_equals_transformers_schedules_at_a_fixed_length(typed_cfg, kind, total, warm):
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_wsd_schedule,
    )

    from mtp_train.lit.schedule import lr_scheduler

    tc = typed_cfg(*FAST, f"train.lr_schedule={kind}", f"train.warmup_steps={warm}", "train.lr=1.0",
                   "train.min_lr_ratio=0.1", "train.decay_fraction=0.2").train

    def run(make):
        o = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched, out = make(o), []
        for _ in range(total + 3):  # past the end too
            out.append(o.param_groups[0]["lr"])
            o.step()
            sched.step()
        return out

    w = min(warm, total)
    reference = {
        "cosine": lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, num_warmup_steps=w, num_training_steps=total,
                                                                        min_lr_rate=0.1),
        "constant": lambda o: get_constant_schedule_with_warmup(o, num_warmup_steps=w),
        "wsd": lambda o: get_wsd_schedule(o, num_warmup_steps=w, num_training_steps=total, min_lr_ratio=0.1,
                                          num_decay_steps=max(1, min(total - w, round(0.2 * total)))),
    }[kind]
    assert run(lambda o: lr_scheduler(o, tc, total)) == pytest.approx(run(reference), abs=1e-12)


def test_lr_shape_follows_a_revised_length_and_survives_the_scheduler_state(typed_cfg):
    from mtp_train.lit.schedule import lr_scheduler

    tc = typed_cfg(*FAST, "train.warmup_steps=2", "train.lr=1.0", "train.min_lr_ratio=0.1").train
    o = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_scheduler(o, tc, 1000)
    for _ in range(10):
        o.step()
        sched.step()
    sched.lr_lambdas[0].total = 20  # the plan shrank: step 10 of 20 is half-way down the cosine
    sched.step()
    assert o.param_groups[0]["lr"] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 18)))
    state = sched.state_dict()
    o2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    again = lr_scheduler(o2, tc, 1000)
    again.load_state_dict(state)
    assert again.lr_lambdas[0].total == 20


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_trainer(step=0):
    return SimpleNamespace(global_step=step, should_stop=False, sanity_checking=False, datamodule=None,
                           state=SimpleNamespace(fn="fit"))


def drive(budget, clock, trainer, module, step_s, steps, val_every=None, val_s=0.0):
    """Run `steps` optimizer steps of `step_s` seconds through the callback's hooks, with a
    validation of `val_s` seconds every `val_every` steps, until it asks to stop."""
    for _ in range(steps):
        clock.t += step_s
        trainer.global_step += 1
        budget.on_train_batch_end(trainer, module, None, None, 0)
        if trainer.should_stop:
            break
        if val_every and trainer.global_step % val_every == 0:
            budget.on_validation_start(trainer, module)
            clock.t += val_s
            budget.on_validation_end(trainer, module)
    return trainer.global_step


def test_the_plan_fills_the_budget_with_steps_and_validations():
    from mtp_train.lit.budget import TimeBudget

    clock, trainer = Clock(), fake_trainer()
    module = SimpleNamespace(lr_shape=SimpleNamespace(total=10_000))
    budget = TimeBudget(600, min_steps=10, max_steps=10_000, val_interval=50, clock=clock)
    budget.on_train_start(trainer, module)
    # the first two steps are slow (allocation) and not timed; then 2 s a step, 20 s a validation
    clock.t += 10
    trainer.global_step = 1
    budget.on_train_batch_end(trainer, module, None, None, 0)
    steps = drive(budget, clock, trainer, module, 2.0, 10_000, val_every=50, val_s=20.0)
    # 600 s >= 10 + 2 s x n + 20 s x (n // 50) + the final validation's 20 s: n = 245 at most
    best = max(n for n in range(1000) if 10 + 2 * n + 20 * (n // 50) + 20 <= 600)
    assert 0.97 * best <= steps <= best and trainer.should_stop
    assert module.lr_shape.total == budget.planned == steps
    assert budget.spent + 20 <= 600 + 2.0
    assert budget.revisions[0][0] == 10  # the first plan after 8 timed steps
    # a validation after the last step does not move the plan past the steps run
    budget.on_validation_start(trainer, module)
    clock.t += 1.0
    budget.on_validation_end(trainer, module)
    assert budget.planned == steps


def test_a_slow_machine_keeps_the_floor_and_the_cap_holds_on_a_fast_one():
    from mtp_train.lit.budget import TimeBudget

    for step_s, floor, cap, expected in ((30.0, 40, 1000, 40), (0.01, 5, 100, 100)):
        clock, trainer = Clock(), fake_trainer()
        module = SimpleNamespace(lr_shape=SimpleNamespace(total=cap))
        budget = TimeBudget(60, min_steps=floor, max_steps=cap, clock=clock)
        budget.on_train_start(trainer, module)
        assert drive(budget, clock, trainer, module, step_s, 10_000) == expected
        assert module.lr_shape.total == expected


def test_a_floor_past_the_budget_widens_lightnings_max_time_and_one_that_fits_does_not():
    import datetime

    from lightning.pytorch.callbacks import Timer

    from mtp_train.lit.budget import TimeBudget, backstop_s

    # (budget s, widened): spent before the steps are timed (guessed from the first step at once); spent
    # later, at the first plan (step 10: 33 s of 60); a budget the floor fits in
    for seconds, widened in ((0.0, True), (60.0, True), (600.0, False)):
        step_s = 3.3
        clock, trainer = Clock(), fake_trainer()
        timer = Timer(duration=datetime.timedelta(seconds=backstop_s(seconds)), verbose=False)
        trainer.callbacks = [timer]
        module = SimpleNamespace(lr_shape=SimpleNamespace(total=1000))
        budget = TimeBudget(seconds, min_steps=100, max_steps=1000, clock=clock, widen_timer=True)
        budget.on_train_start(trainer, module)
        drive(budget, clock, trainer, module, step_s, 10)
        if widened:
            assert timer._duration >= backstop_s(100 * step_s) - 1.0
        else:
            assert timer._duration == backstop_s(seconds)
        steps = drive(budget, clock, trainer, module, step_s, 10_000)
        if widened:  # the floor's 100 steps x 3.3 s: Timer's limit covers them at its own margin
            assert steps == 100 and budget.summary(steps)["floor_s"] == pytest.approx(100 * step_s, rel=0.05)
            assert timer._duration >= backstop_s(100 * step_s) - 1.0
        else:
            assert steps > 100 and budget.floor_s is None
            assert timer._duration == backstop_s(seconds)


def test_a_max_time_the_user_set_is_never_widened_and_the_floor_survives_a_checkpoint():
    import datetime

    from lightning.pytorch.callbacks import Timer

    from mtp_train.lit.budget import TimeBudget, backstop_s

    clock, trainer = Clock(), fake_trainer()
    timer = Timer(duration=datetime.timedelta(seconds=90), verbose=False)  # trainer.max_time=00:00:01:30
    trainer.callbacks = [timer]
    module = SimpleNamespace(lr_shape=SimpleNamespace(total=1000))
    budget = TimeBudget(0.0, min_steps=100, max_steps=1000, clock=clock)  # widen_timer off: not our Timer
    budget.on_train_start(trainer, module)
    drive(budget, clock, trainer, module, 3.3, 30)
    assert budget.floor_s is not None and timer._duration == 90
    # resumed: the floor comes back with the state, and our own backstop is widened before the first step
    again = TimeBudget(0.0, min_steps=100, max_steps=1000, clock=clock, widen_timer=True)
    again.load_state_dict(budget.state_dict())
    ours = Timer(duration=datetime.timedelta(seconds=backstop_s(0.0)), verbose=False)
    resumed = fake_trainer(step=30)
    resumed.callbacks = [ours]
    again.on_train_start(resumed, module)
    assert again.floor_s == budget.floor_s and ours._duration == pytest.approx(backstop_s(budget.floor_s))


def test_the_plan_follows_a_machine_that_slows_down():
    from mtp_train.lit.budget import TimeBudget

    clock, trainer = Clock(), fake_trainer()
    module = SimpleNamespace(lr_shape=SimpleNamespace(total=10_000))
    budget = TimeBudget(300, min_steps=1, max_steps=10_000, revise=10, clock=clock)
    budget.on_train_start(trainer, module)
    drive(budget, clock, trainer, module, 1.0, 50)  # 1 s a step: ~300 planned
    first = budget.planned
    drive(budget, clock, trainer, module, 3.0, 10_000)  # then 3 s a step
    assert first >= 280 and trainer.global_step < 0.6 * first
    assert budget.spent <= 300 + 3.0 * 10  # over by at most one revision interval's steps


def test_the_budget_state_survives_a_checkpoint_and_a_deadline_adds_the_time_left_now():
    from mtp_train.lit.budget import TimeBudget

    clock, trainer = Clock(), fake_trainer()
    module = SimpleNamespace(lr_shape=SimpleNamespace(total=500))
    a = TimeBudget(100, min_steps=1, max_steps=500, clock=clock)
    a.on_train_start(trainer, module)
    drive(a, clock, trainer, module, 1.0, 30)
    state = a.state_dict()
    assert torch.load  # the state is plain numbers: it loads with weights_only
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=True)
    b = TimeBudget(100, min_steps=1, max_steps=500, clock=clock)
    b.load_state_dict(restored)
    assert (b.spent, b.planned, b.step_seconds()) == (a.spent, a.planned, a.step_seconds())
    module2 = SimpleNamespace(lr_shape=SimpleNamespace(total=500))
    b.on_train_start(trainer, module2)
    assert module2.lr_shape.total == a.planned
    c = TimeBudget(50, min_steps=1, max_steps=500, relative=True, clock=clock)
    c.load_state_dict(restored)
    assert c.seconds == pytest.approx(50 + a.spent)


@pytest.mark.integration
def test_mtp_train_to_a_time_budget_ends_its_schedule_where_training_ends(typed_cfg, tmp_path):
    cfg = typed_cfg(*FAST, "heads.k=2", "train.time_budget_min=0.1", "train.min_steps=12", "trainer.max_steps=400",
                    "trainer.val_check_interval=20", "train.warmup_steps=2", "train.min_lr_ratio=0.1",
                    f"paths.output_dir={tmp_path}/run")
    t0 = time.time()
    run_train(cfg)
    meta = json.loads((tmp_path / "run" / "heads.json").read_text())
    b = meta["recipe"]["budget"]
    assert 12 <= b["steps"] <= 400 and b["steps"] == meta["recipe"]["steps"], b
    assert b["planned"] in (b["steps"], 12, 400) and b["budget_s"] == pytest.approx(6.0), b
    assert b["spent_s"] <= 6.0 + 30, b  # timing here is loose (a loaded machine); the fake-clock tests hold the plan
    assert time.time() - t0 < 120
    # the CSV-free check of the schedule: the last step ran at the schedule's end (min_lr_ratio x lr)
    from mtp_train.lit.schedule import LrShape

    shape = LrShape(cfg.train, b["planned"])
    assert shape(b["steps"]) == pytest.approx(0.1, abs=0.02) or b["steps"] == 400, b


@pytest.mark.integration
def test_a_passed_deadline_trains_the_floor_of_steps_and_records_the_prediction(typed_cfg, tmp_path):
    cfg = typed_cfg(*FAST, "heads.k=2", f"budget.deadline={time.time() - 60}", "budget.after_train=[clp,eval]",
                    "train.min_steps=6", "trainer.max_steps=400", f"paths.output_dir={tmp_path}/run/train")
    run_train(cfg)
    meta = json.loads((tmp_path / "run" / "train" / "heads.json").read_text())
    b = meta["recipe"]["budget"]
    assert meta["recipe"]["steps"] == 6 and b["training_s"] == 0.0 and b["left_s"] < -59
    after = b["after_train"]
    assert set(after["decodes"]) == {"clp", "eval"} and after["token_s"] > 0 and after["total_s"] > 0
    # run again with another deadline: the same finished run, skipped
    again = typed_cfg(*FAST, "heads.k=2", f"budget.deadline={time.time() + 3600}", "budget.after_train=[clp,eval]",
                      "train.min_steps=6", "trainer.max_steps=400", f"paths.output_dir={tmp_path}/run/train")
    mtime = (tmp_path / "run" / "train" / "heads.safetensors").stat().st_mtime_ns
    run_train(again)
    assert (tmp_path / "run" / "train" / "heads.safetensors").stat().st_mtime_ns == mtime
    # the report says where the minutes went
    from mtp_train.report import write_report

    md = write_report(tmp_path / "run").read_text()
    assert "## Time budget" in md and "6 steps (floor 6, cap 400)" in md and "predicted" in md


def test_decodes_after_training_count_every_mode_prompt_round_and_threshold(typed_cfg):
    from mtp_train.pipeline.budget import decodes_after_train, predict_after_train

    cfg = typed_cfg(*FAST, "budget.after_train=[clp,eval]", "eval.n_prompts=20", "eval.rounds=2",
                    "eval.modes=[verify,tree,clp]", "eval.sampling.temperatures=[1.0]", "clp.calib_prompts=3",
                    "clp.thresholds=[0.9,0.8]")
    # clp: 3 prompts x (greedy + the first threshold; the sweep stops at a failure);
    # eval: 20 prompts x 2 rounds x (HF + 3 modes + HF sampled + verify and tree sampled) + the dtype probe
    assert decodes_after_train(cfg) == {"clp": 3 * 2, "eval": 20 * 2 * (4 + 3) + 4}
    from mtp_train.pipeline.budget import DECODE_OVERHEAD, STAGE_FIXED_S, Rate

    p = predict_after_train(cfg, Rate(prefill_s=0.5, token_s=0.1))
    one = 0.5 + (cfg.eval.max_new_tokens - 1) * 0.1  # a prefill (with the first token), then the rest
    assert p["total_s"] == pytest.approx((6 + 284) * one * DECODE_OVERHEAD + 2 * STAGE_FIXED_S * 2, abs=0.2)
    assert decodes_after_train(typed_cfg(*FAST)) == {}


def test_calibration_is_priced_for_the_predictors_the_evaluation_decodes(typed_cfg):
    from mtp_train.pipeline.budget import calibration_decodes, decoded_kinds, decodes_after_train

    base = (*FAST, "budget.after_train=[clp,eval]", "clp.calib_prompts=3", "clp.thresholds=[0.9,0.8]")
    both = typed_cfg(*base, "eval.modes=[verify,clp,gate]")
    assert decoded_kinds(both) == ["clp", "gate"]
    # the greedy reference and each kind's first threshold: the sweep stops at a failure, and the
    # further thresholds are decoded while the deadline leaves the time (calibration_room)
    assert decodes_after_train(both)["clp"] == calibration_decodes(both, ["clp", "gate"]) == 3 * (1 + 1 * 2)
    every = typed_cfg(*base, "eval.modes=[verify,clp,gate]", "clp.stop_at_failure=false")
    assert decodes_after_train(every)["clp"] == calibration_decodes(every, ["clp", "gate"]) == 3 * (1 + 2 * 2)
    assert decoded_kinds(typed_cfg(*base, "eval.modes=[verify,clp+verify]")) == ["clp"]
    none = typed_cfg(*base, "eval.modes=[verify,tree]")
    assert decoded_kinds(none) == [] and decodes_after_train(none)["clp"] == 0


def test_a_rate_scales_its_prefill_to_the_prompt_on_the_line_through_one_token_and_the_probe():
    from mtp_train.pipeline.budget import Rate

    probe = Rate(prefill_s=0.50, token_s=0.06, prompt_tokens=192)

    def line(n):  # the straight line through (1 token, token_s) and (192 tokens, the measured prefill)
        x0, y0, x1, y1 = 1, 0.06, 192, 0.50
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    for n in (1, 2, 47, 100, 400):
        r = probe.for_prompt(n)
        assert r.prefill_s == pytest.approx(line(n)) and r.token_s == 0.06 and r.prompt_tokens == n
    assert probe.for_prompt(192) is probe
    assert Rate(0.5, 0.06).for_prompt(47) == Rate(0.5, 0.06)  # no probe length recorded: as measured
    assert Rate(0.05, 0.06, 10).for_prompt(5).prefill_s == 0.06  # never below one token's time
    assert probe.for_prompt(47).decode_s(48) < probe.decode_s(48)


def test_mtp_clp_prices_the_evaluation_on_its_own_median_prompt(typed_cfg, tmp_path, monkeypatch):
    """mtp-clp's calibration decision prices the evaluation as mtp-eval will: on the median of the
    prompts it decodes, at training's rate with the prefill scaled to that prompt (same CPU and
    dtype), else measured on that prompt; on the calibration prompts where the evaluation's cannot
    be read."""
    import types

    import torch

    import mtp_train.pipeline.budget as budget
    import mtp_train.pipeline.evaluation as evaluation
    from mtp_train.errors import DataError
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.pipeline.clp_run import deadline_kinds

    seen = {}

    def priced(cfg, rate, left, pending, calibration_rate=None):
        seen.update(rate=rate, calibration=calibration_rate)
        return [], {}

    monkeypatch.setattr(budget, "kinds_to_calibrate", priced)
    monkeypatch.setattr(budget, "decode_rate", lambda b, prompt, dtype: seen.update(probed=len(prompt)) or
                        budget.Rate(0.2, 0.05, len(prompt)))
    monkeypatch.setattr(evaluation, "select_prompts", lambda cfg, b: ([[1] * 30, [1] * 10, [1] * 20, [1] * 90], 0))
    backbone = types.SimpleNamespace(model=types.SimpleNamespace(dtype=torch.float32))
    cfg = typed_cfg(*FAST, f"budget.deadline={time.time() + 600}", f"clp.train_run={tmp_path}")

    def record(cpu):
        after = {"prefill_s": 0.5, "token_s": 0.06, "prompt_tokens": 192}
        (tmp_path / "heads.json").write_text(json.dumps(
            {"recipe": {"budget": {"cpu": cpu, "dtype": "float32", "after_train": after}}}))

    record(cpu_model())
    calibration_prompts = [[1] * 100, [1] * 300, [1] * 200]
    deadline_kinds(cfg, backbone, calibration_prompts, ["clp"])
    trained = budget.Rate(0.5, 0.06, 192)
    assert seen["rate"] == trained.for_prompt(30) and "probed" not in seen
    assert seen["calibration"] == trained.for_prompt(200)  # the calibration decodes its own prompts
    record("another CPU")
    deadline_kinds(cfg, backbone, calibration_prompts, ["clp"])
    assert seen["probed"] == 30 and seen["rate"].prompt_tokens == 30 and seen["calibration"].prompt_tokens == 200
    # a heads.json from before the probe's length was recorded: measured here too
    (tmp_path / "heads.json").write_text(json.dumps({"recipe": {"budget": {
        "cpu": cpu_model(), "dtype": "float32", "after_train": {"prefill_s": 0.5, "token_s": 0.06}}}}))
    seen.clear()
    deadline_kinds(cfg, backbone, calibration_prompts, ["clp"])
    assert seen["probed"] == 30

    for error in (DataError("eval.prompts: no such file"), OSError("the source's file went away")):
        def unreadable(cfg, b, error=error):
            raise error

        monkeypatch.setattr(evaluation, "select_prompts", unreadable)
        seen.clear()
        deadline_kinds(cfg, backbone, [[1] * 5, [1] * 7, [1] * 9], ["clp"])
        assert seen["probed"] == 7


def test_the_probes_are_shortened_only_where_the_greedy_decodes_are(typed_cfg, monkeypatch):
    """mtp-eval times its layouts, cost curve and drafts in fewer rounds only where the deadline
    shortened the greedy decodes (or they overrun at their floor): sampled runs priced over, which
    it decides later from the greedy decodes' measured time, leave the probes whole."""
    import mtp_train.pipeline.budget as budget
    from mtp_train.pipeline.evaluation import size_to_deadline

    rate = budget.Rate(0.3, 0.1)
    monkeypatch.setattr(budget, "decode_rate", lambda *a, **k: rate)
    base = (*FAST, "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree]",
            "eval.sampling.temperatures=[1.0]", "budget.margin_min=0")
    asked = typed_cfg(*base)
    greedy, full = budget.eval_seconds(budget.without_sampled(asked), rate), budget.eval_seconds(asked, rate)
    backbone = SimpleNamespace(model=SimpleNamespace(dtype=torch.float32))

    def sized(left):
        return size_to_deadline(typed_cfg(*base, f"budget.deadline={time.time() + left}"), backbone, [1] * 5)

    cfg, rec = sized(full + 60)
    assert not rec["shortened"] and not rec["cut"]
    cfg, rec = sized((greedy + full) / 2)
    assert rec["sampled_deferred"] and not rec["shortened"] and cfg.eval.max_new_tokens == 48
    cfg, rec = sized(greedy * 0.6)
    assert rec["shortened"] and cfg.eval.max_new_tokens < 48
    cfg, rec = sized(5)  # at the floor and still over
    assert rec["shortened"] and any(c.startswith("still") for c in rec["cut"])


def test_under_a_deadline_clp_calibrates_only_what_the_evaluation_will_still_decode(typed_cfg):
    """The calibration's decodes are spent only where the evaluation, sized in the time they leave,
    keeps the predictor's mode; otherwise those minutes go to the evaluation."""
    from mtp_train.pipeline.budget import (
        DECODE_OVERHEAD,
        Rate,
        calibration_decodes,
        eval_seconds,
        kinds_to_calibrate,
    )

    args = (*FAST, "budget.after_train=[clp,eval]", "clp.calib_prompts=3", "clp.thresholds=[0.9,0.8]",
            "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree,clp]",
            "eval.sampling.temperatures=[0]")
    cfg = typed_cfg(*args, "budget.margin_min=0")  # no slack (size_eval's half margin): exact edges
    rate = Rate(prefill_s=0.3, token_s=0.1)
    calib = calibration_decodes(cfg, ["clp"]) * rate.decode_s(48) * DECODE_OVERHEAD
    need = eval_seconds(cfg, rate)
    kinds, why = kinds_to_calibrate(cfg, rate, need + calib + 1)
    assert kinds == ["clp"] and set(why) == {"gate"} and "decodes no mode of it" in why["gate"]
    kinds, why = kinds_to_calibrate(cfg, rate, need + calib - 5)  # the evaluation would cut the clp mode
    assert kinds == [] and "cuts their modes" in why["clp"] and "decodes no mode" in why["gate"]
    # with a margin, the evaluation keeps a mode priced within half of it over, as mtp-eval will
    assert kinds_to_calibrate(typed_cfg(*args, "budget.margin_min=1"), rate, need + calib - 5)[0] == ["clp"]
    # the calibration is priced at its own prompts' rate where one is given
    slow = Rate(prefill_s=3.0, token_s=0.1)
    assert kinds_to_calibrate(cfg, rate, need + calib + 1, calibration_rate=slow)[0] == []
    # a mode list without span modes calibrates nothing, however much time there is
    kinds, why = kinds_to_calibrate(typed_cfg(*FAST, "eval.modes=[verify,tree]"), rate, 1e6)
    assert kinds == [] and set(why) == {"clp", "gate"}
    # with too little time for the evaluation's span modes anyway, calibration is not blamed
    kinds, why = kinds_to_calibrate(cfg, rate, 10.0)
    assert kinds == [] and "whatever calibration takes" in why["clp"]
    # only what is pending is priced: the gate alone, where clp is calibrated already
    both = typed_cfg(*FAST, "budget.after_train=[clp,eval]", "clp.calib_prompts=3", "clp.thresholds=[0.9,0.8]",
                     "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree,clp,gate]",
                     "eval.sampling.temperatures=[0]", "budget.margin_min=0")
    one = calibration_decodes(both, ["gate"]) * rate.decode_s(48) * DECODE_OVERHEAD
    two = calibration_decodes(both, ["clp", "gate"]) * rate.decode_s(48) * DECODE_OVERHEAD
    left = eval_seconds(both, rate) + (one + two) / 2  # enough for one kind's thresholds, not two
    assert kinds_to_calibrate(both, rate, left, pending=["gate"]) == (["gate"], {})
    assert kinds_to_calibrate(both, rate, left)[0] == []


def test_a_further_threshold_is_decoded_only_where_it_leaves_the_evaluation_its_modes(typed_cfg):
    """calibration_room prices `decodes` more calibration decodes from now as kinds_to_calibrate
    prices them at the start, and sweep_rule stops the sweep on it, keeping the row as a candidate."""
    from mtp_train.evaluation.calibration import pick_threshold
    from mtp_train.pipeline.budget import Rate, calibration_room, calibration_seconds, eval_seconds
    from mtp_train.pipeline.clp_run import sweep_rule

    deadline = 10_000.0
    cfg = typed_cfg(*FAST, "budget.after_train=[clp,eval]", "clp.calib_prompts=3", "clp.thresholds=[0.9,0.8]",
                    "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree,clp]",
                    "eval.sampling.temperatures=[0]", "budget.margin_min=0", f"budget.deadline={deadline}")
    rate, slow = Rate(prefill_s=0.3, token_s=0.1), Rate(prefill_s=3.0, token_s=0.1)
    need, three = eval_seconds(cfg, rate), calibration_seconds(cfg, 3, rate)
    now = deadline - need - three - 1  # room for 3 more decodes, not 6
    room = calibration_room(cfg, rate, clock=lambda: now)
    assert room(3) and not room(6)
    assert not calibration_room(cfg, rate, slow, clock=lambda: now)(3)  # priced at the calibration's own rate
    assert not calibration_room(cfg, rate, clock=lambda: now + 5)(3)  # seconds later, no longer

    greedy = {"repetition_per_prompt": [0.1, 0.1], "backbone_nll_per_prompt": [1.0, 1.0]}

    def row(t, nll):
        return {"threshold": t, "tau": 2 - t, "repetition_per_prompt": [0.1, 0.1], "backbone_nll_per_prompt": [nll, nll]}

    bounds = (0.02, 0.1, 1.0)
    within, outside = row(0.9, 1.05), row(0.9, 1.5)
    assert sweep_rule(bounds)(dict(within), greedy) and not sweep_rule(bounds)(dict(outside), greedy)
    assert sweep_rule(bounds, room, 3)(within, greedy) and "stopped_by_deadline" not in within
    late = row(0.9, 1.05)
    assert not sweep_rule(bounds, room, 6)(late, greedy) and late["stopped_by_deadline"]
    assert pick_threshold([late], greedy, *bounds)["threshold"] == 0.9  # within the bounds: still chosen
    failed = row(0.9, 1.5)
    assert not sweep_rule(bounds, room, 6)(failed, greedy) and "stopped_by_deadline" not in failed
    # a sweep the deadline cut short is not saved under its settings' key: a rerun with time decodes the rest
    from mtp_train.pipeline.clp_run import reusable_key

    assert reusable_key("k", [{**late, "stopped_after": [0.8]}]) is None
    assert reusable_key("k", [{**failed, "stopped_after": [0.8]}]) == "k"  # stopped by a failure: complete
    assert reusable_key("k", [within, row(0.8, 1.05)]) == "k"


def test_the_sweep_asks_nothing_after_its_last_threshold(monkeypatch):
    """passes (and with it the deadline's room) is asked only where another threshold would follow."""
    import mtp_train.evaluation.calibration as cal
    from mtp_train.clp import LinearCLP

    def fake_measure(decoder, prompts, max_new_tokens, mode, policy=None, bar=None):
        t = None if policy is None else policy.threshold
        return ({"tokens_per_s": 1.0, "tau": 1.0, "threshold": t}, [[1, 2]])

    monkeypatch.setattr(cal, "measure_decode", fake_measure)
    asked = []
    _, rows = cal.sweep_thresholds(None, LinearCLP(8, 3), [[1]], [0.8, 0.9], 2, progress=False,
                                   passes=lambda row, greedy: asked.append(row["threshold"]) or True)
    assert asked == [0.9] and [r["threshold"] for r in rows] == [0.9, 0.8]


@pytest.mark.bad_input
@pytest.mark.parametrize("overrides,key", [
    (["train.time_budget_min=-1"], "train.time_budget_min"),
    (["train.time_budget_min=inf"], "train.time_budget_min"),
    (["train.min_steps=0"], "train.min_steps"),
    (["budget.after_train=[train]"], "budget.after_train"),
    (["budget.deadline=nan"], "budget.deadline"),
    (["budget.distill_share=1.5"], "budget.distill_share"),
    (["budget.train_first_min=-1"], "budget.train_first_min"),
    (["data.distill.min_train_prompts=-1"], "data.distill.min_train_prompts"),
])
def test_bad_budget_settings_name_their_key(typed_cfg, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        typed_cfg(*FAST, *overrides)


@pytest.mark.bad_input
@pytest.mark.integration
def test_a_floor_above_the_cap_is_refused_before_training(typed_cfg, tmp_path):
    cfg = typed_cfg(*FAST, "train.time_budget_min=1", "train.min_steps=50", "trainer.max_steps=10",
                    f"paths.output_dir={tmp_path}/run")
    with pytest.raises(ConfigError, match=r"train\.min_steps: 50 is above trainer\.max_steps=10"):
        run_train(cfg)
    assert not (tmp_path / "run" / "heads.safetensors").exists()


def test_an_evaluation_is_cut_to_its_deadline_sampling_first_then_modes_then_tokens(typed_cfg):
    from mtp_train.pipeline.budget import MIN_EVAL_TOKENS, Rate, eval_seconds, size_eval

    cfg = typed_cfg(*FAST, "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree,clp]",
                    "eval.sampling.temperatures=[0,1.0]")
    tok = Rate(prefill_s=0.3, token_s=0.1)
    full = eval_seconds(cfg, tok)
    same, cuts = size_eval(cfg, tok, full + 1)
    assert same == cfg and cuts == []
    no_sampling = eval_seconds(typed_cfg(*FAST, "eval.n_prompts=20", "eval.max_new_tokens=48",
                                         "eval.modes=[verify,tree,clp]"), tok)
    c1, cuts = size_eval(cfg, tok, no_sampling + 1)
    assert c1.eval.sampling.temperatures == [0] and c1.eval.modes == ["verify", "tree", "clp"]
    assert len(cuts) == 1 and "T=[1.0]" in cuts[0]
    core = eval_seconds(typed_cfg(*FAST, "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree]"), tok)
    c2, cuts = size_eval(cfg, tok, core + 1)
    assert c2.eval.modes == ["verify", "tree"] and c2.eval.max_new_tokens == 48 and len(cuts) == 2
    c3, cuts = size_eval(cfg, tok, core / 2)
    assert c3.eval.n_prompts == 20 and MIN_EVAL_TOKENS <= c3.eval.max_new_tokens < 48
    assert eval_seconds(c3, tok) <= core / 2 and "max_new_tokens 48 ->" in cuts[-1]
    c4, cuts = size_eval(cfg, tok, 1.0)  # nothing fits: the floor, and by how much it overruns
    assert c4.eval.max_new_tokens == MIN_EVAL_TOKENS and "over the deadline" in cuts[-1]


def test_a_mode_is_not_cut_for_an_overrun_within_half_the_margin(typed_cfg):
    """The evaluation's price is a probe's: a mode priced a few seconds over the time left stays,
    up to half of budget.margin_min; past that (or with no margin) it is cut as before."""
    from mtp_train.pipeline.budget import Rate, eval_seconds, eval_slack_s, size_eval

    args = (*FAST, "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree,clp]")
    tok = Rate(prefill_s=0.3, token_s=0.1)
    cfg = typed_cfg(*args, "budget.margin_min=1")
    need = eval_seconds(cfg, tok)
    assert eval_slack_s(cfg) == 30.0
    kept, cuts = size_eval(cfg, tok, need - 20)
    assert kept.eval.modes == ["verify", "tree", "clp"] and kept.eval.max_new_tokens == 48 and cuts == []
    cut, cuts = size_eval(cfg, tok, need - 40)
    assert cut.eval.modes == ["verify", "tree"] and "modes ['clp']" in cuts[0]
    strict, _ = size_eval(typed_cfg(*args, "budget.margin_min=0"), tok, need - 20)
    assert strict.eval.modes == ["verify", "tree"]


def test_a_deferred_sampled_run_is_left_to_the_greedy_decodes_where_they_fit(typed_cfg):
    """defer_sampled (mtp-eval under a deadline): a sampled run the probe prices over the time left
    stays while the greedy part fits, and is cut first as before when even that does not fit."""
    from mtp_train.pipeline.budget import Rate, eval_seconds, size_eval

    cfg = typed_cfg(*FAST, "eval.n_prompts=20", "eval.max_new_tokens=48", "eval.modes=[verify,tree,clp]",
                    "eval.sampling.temperatures=[0,1.0]", "budget.margin_min=0")  # no slack: exact edges
    tok = Rate(prefill_s=0.3, token_s=0.1)
    greedy = eval_seconds(typed_cfg(*FAST, "eval.n_prompts=20", "eval.max_new_tokens=48",
                                    "eval.modes=[verify,tree,clp]"), tok)
    assert greedy < eval_seconds(cfg, tok)
    kept, cuts = size_eval(cfg, tok, greedy + 1, defer_sampled=True)
    assert kept == cfg and cuts == []
    cut, cuts = size_eval(cfg, tok, greedy - 1, defer_sampled=True)
    assert cut.eval.sampling.temperatures == [0] and "T=[1.0]" in cuts[0]


def test_sampled_runs_are_kept_in_order_while_the_greedy_decodes_say_they_fit():
    from mtp_train.evaluation.runner import SAMPLED_OVERHEAD, sampled_that_fit

    mean_s = {"hf_generate": 2.0, "verify": 1.5, "tree": 1.2, "clp": 2.5}
    names = ["hf_generate", "verify", "tree"]  # clp does not sample
    # a sampled decode costs at least HF's: (2 + 2 + 2) s x 20 decodes x the overhead, per temperature
    one = 6.0 * 20 * SAMPLED_OVERHEAD
    keep, rec = sampled_that_fit(mean_s, names, 20, [0.7, 1.0], 2 * one + 30, tail_s=30)
    assert keep == [0.7, 1.0] and rec["cut"] == [] and rec["per_temperature_s"] == pytest.approx(one, abs=0.1)
    keep, rec = sampled_that_fit(mean_s, names, 20, [0.7, 1.0], 2 * one + 29, tail_s=30)
    assert keep == [0.7] and rec["cut"] == [1.0]
    keep, rec = sampled_that_fit(mean_s, names, 20, [0.7, 1.0], one, tail_s=30)
    assert keep == [] and rec["cut"] == [0.7, 1.0]
    # a mode slower than HF is priced at its own time; one not measured greedy at the slowest measured
    assert sampled_that_fit(mean_s, ["hf_generate", "clp", "relaxed"], 1, [1.0], 1e9, 0)[1][
        "per_temperature_s"] == pytest.approx((2.0 + 2.5 + 2.5) * SAMPLED_OVERHEAD, abs=0.1)


def test_under_a_deadline_modes_of_an_uncalibrated_predictor_are_not_decoded(typed_cfg):
    """A predictor mtp-clp could not calibrate holds threshold 1.0: its modes would decode as greedy
    does, so under a deadline they are dropped (and named in the cut) before the sampled runs are
    priced; a calibrated one, a threshold given by hand, or the last mode left stay."""
    from mtp_train.pipeline.evaluation import drop_uncalibrated

    def policy(calibrated):
        return SimpleNamespace(calibrated=calibrated)

    cfg = typed_cfg(*FAST, "eval.modes=[verify,tree,clp,clp+verify]", "eval.sampling.temperatures=[0,1.0]")
    out, cut = drop_uncalibrated(cfg, {"clp": policy(False), "clp+verify": policy(False)})
    assert out.eval.modes == ["verify", "tree"] and out.eval.sampling.temperatures == [0, 1.0]
    assert len(cut) == 1 and "clp" in cut[0] and "clp+verify" in cut[0] and "not calibrated" in cut[0]
    same, cut = drop_uncalibrated(cfg, {"clp": policy(True), "clp+verify": policy(True)})
    assert same is cfg and cut == []
    by_hand = typed_cfg(*FAST, "eval.modes=[verify,clp]", "eval.span_threshold=0.9")
    assert drop_uncalibrated(by_hand, {"clp": policy(False)}) == (by_hand, [])
    only = typed_cfg(*FAST, "eval.modes=[clp]")
    assert drop_uncalibrated(only, {"clp": policy(False)}) == (only, [])
    # the sampled runs were asked for the dropped mode only: none is left to sample
    one = typed_cfg(*FAST, "eval.modes=[verify,clp+verify]", "eval.sampling.temperatures=[0,1.0]",
                    "eval.sampling.modes=[clp+verify]")
    out, _ = drop_uncalibrated(one, {"clp+verify": policy(False)})
    assert out.eval.modes == ["verify"] and out.eval.sampling.temperatures == [0]


@pytest.mark.parametrize("hours", [-25, 25, -1e6])
def test_a_deadline_no_run_could_mean_is_refused_naming_the_key(hours):
    from mtp_train.pipeline.budget import check_deadline

    now = 1.8e9
    with pytest.raises(ConfigError, match=rf"budget.deadline: .* h in the {'past' if hours < 0 else 'future'}"):
        check_deadline(now + hours * 3600, now)
    check_deadline(now - 600, now)  # just passed: the floors run
    check_deadline(now + 1800, now)


@pytest.mark.integration
def test_a_deadline_years_past_trains_nothing_and_marks_nothing_finished(typed_cfg, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="budget.deadline"):
        run_train(typed_cfg(*FAST, "heads.k=2", "budget.deadline=1000", "train.min_steps=2", "trainer.max_steps=40",
                            f"paths.output_dir={run}"))
    assert not (run / "heads.json").exists()


@pytest.mark.integration
def test_a_resumed_run_with_another_save_interval_keeps_saving_to_the_checkpoint_resume_reads(typed_cfg, tmp_path):
    """Lightning names a last checkpoint it cannot match to its own record last-v1.ckpt; a run killed
    after that would resume from the older last.ckpt and lose what it trained since."""
    run = tmp_path / "run"
    run_train(typed_cfg(*FAST, "heads.k=2", "trainer.max_steps=4", "trainer.val_check_interval=2",
                        f"paths.output_dir={run}"))
    run_train(typed_cfg(*FAST, "heads.k=2", "trainer.max_steps=9", "trainer.val_check_interval=3",
                        "trainer.precision=bf16-mixed", f"paths.output_dir={run}"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    # resumed in another precision: heads.json names both, in order, not the last only (hostile round 3)
    record = json.loads((run / "heads.json").read_text())["recipe"]["precision"]
    assert record["used"] == "bf16-mixed" and record["history"] == ["32-true", "bf16-mixed"]


def test_distillation_stops_at_its_share_of_the_time_left_to_the_deadline(typed_cfg):
    from data_prep.stages import distill_stop_at

    now = 1.8e9
    assert distill_stop_at(typed_cfg(*FAST, f"budget.deadline={now + 1200}", "budget.distill_share=0.25"), now) == now + 300
    assert distill_stop_at(typed_cfg(*FAST, f"budget.deadline={now - 60}", "budget.distill_share=0.25"), now) == now
    assert distill_stop_at(typed_cfg(*FAST, f"budget.deadline={now + 1200}"), now) is None  # no share: no stop
    assert distill_stop_at(typed_cfg(*FAST, "budget.distill_share=0.25"), now) is None  # no deadline
    with pytest.raises(ConfigError, match="budget.deadline"):
        distill_stop_at(typed_cfg(*FAST, f"budget.deadline={now + 1e6}", "budget.distill_share=0.25"), now)


def test_the_decode_rate_splits_the_prefill_from_the_tokens(monkeypatch):
    """HF generate taking 2 s to prefill and 0.1 s a token after it: the rate says so, where the old
    seconds-per-token (one generate / its tokens) counted the prefill into every token."""
    from mtp_train.evaluation import runner
    from mtp_train.pipeline import budget

    monkeypatch.setattr(runner, "hf_generate", lambda b, prompt, n, eos: ([0] * n, 2.0 + 0.1 * (n - 1)))
    backbone = SimpleNamespace(model=SimpleNamespace(dtype=torch.float32))
    rate = budget.decode_rate(backbone, [1] * 192, torch.float32)
    assert rate.prefill_s == pytest.approx(2.0) and rate.token_s == pytest.approx(0.1)
    assert rate.decode_s(48) == pytest.approx(2.0 + 47 * 0.1)


def test_training_first_minutes_come_before_the_sampled_runs_reserve(typed_cfg, monkeypatch):
    """A slow machine (0.1 s a token): reserving the evaluation's sampled run leaves training less
    than budget.train_first_min, so the run is not reserved and training gets up to those minutes
    (not more: the rest stays for the sampled run); a fast one, or the rule off, reserves it as before."""
    from mtp_train.pipeline import budget

    now = 1.8e9
    monkeypatch.setattr(budget, "decode_rate", lambda *a, **k: budget.Rate(prefill_s=0.5, token_s=0.1))
    args = [*FAST, "budget.after_train=[clp,eval]", "eval.n_prompts=20", "eval.max_new_tokens=48",
            "eval.modes=[verify,tree]", "eval.sampling.temperatures=[0,1.0]", "budget.margin_min=1"]
    rate = budget.Rate(prefill_s=0.5, token_s=0.1)
    full = budget.predict_after_train(typed_cfg(*args), rate)["total_s"]
    greedy = budget.predict_after_train(typed_cfg(*args, "eval.sampling.temperatures=[0]"), rate)["total_s"]
    assert greedy < full
    left = full + 60 + 120  # with the sampled run reserved, training would get 2 min
    deadline = f"budget.deadline={now + left}"

    off, rec = budget.deadline_training_seconds(typed_cfg(*args, deadline), None, [1], now=now)
    assert off == pytest.approx(120, abs=1) and "sampled_unreserved" not in rec
    first, rec = budget.deadline_training_seconds(typed_cfg(*args, deadline, "budget.train_first_min=5"), None, [1], now=now)
    assert first == pytest.approx(300, abs=1)  # 5 min, though the greedy part alone would leave more
    assert left - greedy - 60 > 300 and rec["after_train"]["total_s"] == pytest.approx(greedy, abs=0.2)
    assert rec["sampled_unreserved"]["temperatures"] == [1.0] and rec["sampled_unreserved"]["training_with_s"] == pytest.approx(120, abs=1)
    most, _ = budget.deadline_training_seconds(typed_cfg(*args, deadline, "budget.train_first_min=60"), None, [1], now=now)
    assert most == pytest.approx(left - greedy - 60, abs=1)  # all the greedy part leaves, no more
    roomy, rec = budget.deadline_training_seconds(typed_cfg(*args, f"budget.deadline={now + full + 60 + 900}",
                                                            "budget.train_first_min=5"), None, [1], now=now)
    assert roomy == pytest.approx(900, abs=1) and "sampled_unreserved" not in rec


def test_the_report_says_when_the_sampled_runs_were_not_reserved():
    from mtp_train.report import _budget_section

    b = {"cpu": "AMD EPYC", "dtype": "float32", "deadline": 1.8e9, "left_s": 1062.0, "margin_s": 60.0,
         "after_train": {"token_s": 0.0735, "prefill_s": 0.54, "decodes": {"clp": 12, "eval": 64}, "total_s": 540.0},
         "budget_s": 470.0, "spent_s": 480.0, "steps": 250, "min_steps": 100, "max_steps": 5000, "step_s": 1.75,
         "validation_s": 13.0}
    plain = "\n".join(_budget_section({"recipe": {"budget": b}}, None, {"clp": 90.0, "eval": 400.0}))
    assert "not reserved" not in plain and "250 steps" in plain
    b["sampled_unreserved"] = {"temperatures": [1.0], "training_with_s": 180.0, "sampled_s": 290.0}
    md = "\n".join(_budget_section({"recipe": {"budget": b}}, None, {"clp": 90.0, "eval": 400.0}))
    assert "sampled runs (T=[1.0], predicted 4.8 min) were not reserved" in md and "3.0 min" in md
