"""Training-step options timed where the code runs (mtp_train/lit/step_options.py) and
trainer.precision=auto chosen by them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_train

FAST = ["debug=smoke"]


def fake_timings(fp32: float, bf16: float, **more: float):
    def timed(backbone, heads, loss_cfg, train_cfg, batches, options, rounds=2):
        per = {"fp32": fp32, "bf16": bf16, **{k.replace("_", "+"): v for k, v in more.items()}}
        return {n: {"first_s": 1.0, "round_s": [per[n] * (len(batches) - 1)] * rounds} for n in options}
    return timed


@pytest.mark.parametrize("native,fp32,bf16,expected", [
    (True, 2.0, 1.0, "bf16-mixed"),   # twice as fast: bf16
    (True, 1.05, 1.0, "32-true"),     # within AUTO_MIN_GAIN: a tie goes to float32
    (True, 1.0, 2.0, "32-true"),      # bf16 slower (no native matmuls in practice)
    (False, 9.0, 1.0, "32-true"),     # no native bf16: not even timed
])
def test_precision_auto_takes_bf16_only_where_it_is_native_and_clearly_faster(monkeypatch, native, fp32, bf16,
                                                                              expected):
    import mtp_train.backbone as bb
    import mtp_train.lit.step_options as so

    monkeypatch.setattr(bb, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(so, "time_options", fake_timings(fp32, bf16))
    choice, record = so.choose_precision(None, None, None, None, [{}] * 4)
    assert choice == expected
    if native:
        assert record["step_s"] == {"fp32": fp32, "bf16": bf16} and record["bf16_gain"] == pytest.approx(fp32 / bf16)
    else:
        assert "no native bf16" in record["why"]


@pytest.mark.parametrize("fp32,bf16,bf16c,expected", [
    (1.31, 1.32, 1.09, ("bf16-mixed", True)),   # the AMX Xeon: bf16 pays only compiled (1.20x)
    (1.27, 1.11, 0.94, ("bf16-mixed", True)),   # the AVX-512 EPYC: both pay
    (1.27, 1.11, 1.09, ("bf16-mixed", False)),  # compiled within COMPILE_MIN_GAIN of eager bf16: eager bf16
    (1.00, 0.98, 0.93, ("32-true", None)),      # neither beats float32 by AUTO_MIN_GAIN: float32 compiled next
])
def test_joint_choice_times_bf16_compiled_beside_float32(monkeypatch, fp32, bf16, bf16c, expected):
    import mtp_train.lit.step_options as so

    seen = []

    def timed(*a, **k):
        seen.append(a[5])
        return fake_timings(fp32, bf16, bf16_compile=bf16c)(*a, **k)

    monkeypatch.setattr(so, "time_options", timed)
    precision, compiled, p_rec, c_rec = so.choose_jointly(None, None, None, None, [{}] * 4)
    assert (precision, compiled) == expected
    assert seen == [["fp32", "bf16", "bf16+compile"]]  # one pass, one compile
    assert p_rec["step_s"] == c_rec["step_s"] == {"fp32": fp32, "bf16": bf16, "bf16+compile": bf16c}
    assert p_rec["bf16_compiled_gain"] == pytest.approx(fp32 / bf16c, abs=1e-3)
    assert c_rec["compile_gain"] == pytest.approx(bf16 / bf16c, abs=1e-3) and c_rec["compile_s"] == 1.0


def test_joint_choice_falls_back_to_the_eager_pair_when_the_compile_fails(monkeypatch):
    import mtp_train.backbone as bb
    import mtp_train.lit.step_options as so

    def timed(backbone, heads, loss_cfg, train_cfg, batches, options, rounds=2):
        if any("compile" in o for o in options):
            raise RuntimeError("InductorError: CppCompileError: C++ compile error\n(long log)")
        return fake_timings(2.0, 1.0)(backbone, heads, loss_cfg, train_cfg, batches, options, rounds)

    monkeypatch.setattr(bb, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(so, "time_options", timed)
    precision, compiled, p_rec, c_rec = so.choose_jointly(None, None, None, None, [{}] * 4)
    assert (precision, compiled) == ("bf16-mixed", False) and p_rec["step_s"] == {"fp32": 2.0, "bf16": 1.0}
    assert c_rec["why"] == "torch.compile failed: RuntimeError: InductorError: CppCompileError: C++ compile error"


@pytest.mark.parametrize("native,joint", [(True, True), (False, False)])
def test_precision_and_compile_auto_are_timed_together_where_bf16_is_native(typed_cfg, monkeypatch, native, joint):
    """resolve_precision hands train.compile its decision when it timed bf16 compiled, and
    resolve_compile then times nothing more; without native bf16 each is timed on its own."""
    from types import SimpleNamespace

    import mtp_train.backbone as bb
    import mtp_train.lit.step_options as so
    import mtp_train.pipeline.training as tr

    calls = []
    monkeypatch.setattr(bb, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(so, "choose_jointly", lambda *a, **k: calls.append("joint") or (
        "bf16-mixed", True, {"j": 1}, {"c": 1}))
    monkeypatch.setattr(so, "choose_precision", lambda *a, **k: calls.append("precision") or ("32-true", {"p": 1}))
    monkeypatch.setattr(so, "choose_compile", lambda *a, **k: calls.append("compile") or (False, {"e": 1}))
    dm = SimpleNamespace(setup=lambda: None, train_dataloader=lambda: iter([{}] * 8))
    cfg = typed_cfg("trainer.precision=auto", "train.compile=auto", "trainer.max_steps=1000")
    precision, p_rec, timed = tr.resolve_precision(cfg, None, None, dm)
    compiled, c_rec = tr.resolve_compile(cfg, None, None, dm, precision, None, 1, timed)
    if joint:
        assert calls == ["joint"] and (precision, compiled, p_rec, c_rec) == ("bf16-mixed", True, {"j": 1}, {"c": 1})
        # on more devices than one the joint decision to compile is not taken
        assert tr.resolve_compile(cfg, None, None, dm, precision, None, 2, timed)[0] is False
    else:
        assert calls == ["precision", "compile"] and (precision, compiled) == ("32-true", False)
    # a run too short to pay a compile back is timed for its precision only
    calls.clear()
    short = typed_cfg("trainer.precision=auto", "train.compile=auto", "trainer.max_steps=20")
    assert tr.resolve_precision(short, None, None, dm)[2] is None and calls == ["precision"]


@pytest.mark.integration
def test_timed_options_train_the_same_heads_to_nearby_losses(typed_cfg, monkeypatch):
    """Every option is a real step: from the same start, one step of fp32 and of bf16 autocast moves
    the heads, and the losses they report agree to bf16's precision."""
    from mtp_train.backbone import load_backbone
    from mtp_train.heads.persist import build_heads
    from mtp_train.lit.data import MTPDataModule
    from mtp_train.lit.step_options import time_options
    from tests.helpers import prepare_tiny

    cfg = typed_cfg(*FAST, "heads=chained", "heads.k=2", "train.feature_noise=0.1")  # the steps draw noise
    prepare_tiny(cfg)
    from mtp_train import layout
    from mtp_train.layout import data_dirs

    backbone = load_backbone(cfg.backbone)
    dm = MTPDataModule(data_dirs(cfg), backbone.tokenizer.pad_token_id or 0, 4, layout.max_length(cfg), k=2,
                       vocab_size=backbone.vocab_size)
    dm.setup()
    batches = [b for _, b in zip(range(3), dm.val_dataloader(), strict=False)]
    heads = build_heads(cfg.heads, backbone)
    before = {n: p.detach().clone() for n, p in heads.named_parameters()}
    rng = torch.get_rng_state()
    from mtp_train.lit.module import TRAIN_ALPHA_STRIDE, MTPHeadsModule

    strides, log_metrics = set(), MTPHeadsModule._log_metrics

    def spy(self, *a, **k):
        strides.add(self.train_alpha_stride)
        return log_metrics(self, *a, **k)

    monkeypatch.setattr(MTPHeadsModule, "_log_metrics", spy)
    out = time_options(backbone, heads, cfg.loss, cfg.train, batches, ["fp32", "bf16", "fp32+alpha-all"], rounds=2)
    assert torch.equal(torch.get_rng_state(), rng)  # training draws what it would have drawn untimed
    assert set(out) == {"fp32", "bf16", "fp32+alpha-all"}
    assert all(len(v["round_s"]) == 2 and v["first_s"] > 0 for v in out.values())
    assert strides == {TRAIN_ALPHA_STRIDE, 1}  # alpha-all: the metric on every position, as before
    assert all(torch.equal(p, before[n]) for n, p in heads.named_parameters())  # copies trained, not these


@pytest.mark.integration
def test_mtp_train_with_precision_auto_records_its_choice(typed_cfg, tmp_path):
    from mtp_train.backbone import cpu_has_native_bf16

    run_train(typed_cfg(*FAST, "heads.k=2", "trainer.precision=auto", f"paths.output_dir={tmp_path}/run"))
    meta = json.loads((tmp_path / "run" / "heads.json").read_text())
    p = meta["recipe"]["precision"]
    assert p["used"] in ("32-true", "bf16-mixed")
    if cpu_has_native_bf16():
        assert set(p["step_s"]) == {"fp32", "bf16"}
        assert (p["used"] == "bf16-mixed") == (p["bf16_gain"] >= 1.1)
    else:
        assert p["used"] == "32-true" and "no native bf16" in p["why"]


@pytest.mark.parametrize("precision,eager,compiled,expected", [
    ("bf16-mixed", 1.0, 0.8, True),   # 1.25x: compiled
    ("32-true", 1.0, 0.97, False),    # within COMPILE_MIN_GAIN: eager
    ("32-true", 1.0, 1.3, False),     # compiled slower: eager
])
def test_compile_auto_keeps_a_compiled_step_only_when_it_is_clearly_faster(monkeypatch, precision, eager, compiled,
                                                                           expected):
    import mtp_train.lit.step_options as so

    base = "bf16" if precision.startswith("bf16") else "fp32"
    monkeypatch.setattr(so, "time_options", fake_timings(eager, eager, **{f"{base}_compile": compiled}))
    choice, record = so.choose_compile(None, None, None, None, [{}] * 4, precision)
    assert choice is expected and record["precision"] == base
    assert record["step_s"] == {base: eager, f"{base}+compile": compiled}
    assert record["compile_gain"] == pytest.approx(eager / compiled, abs=1e-3) and record["compile_s"] == 1.0


def test_compile_auto_trains_eager_when_the_compile_fails(monkeypatch):
    """No C++ compiler, or an operator Inductor cannot lower: eager, with the error in the record."""
    import mtp_train.lit.step_options as so

    def broken(*a, **k):
        raise RuntimeError("InductorError: CppCompileError: C++ compile error\n(long log)")

    monkeypatch.setattr(so, "time_options", broken)
    choice, record = so.choose_compile(None, None, None, None, [{}] * 4, "32-true")
    assert choice is False and record["why"] == "torch.compile failed: RuntimeError: InductorError: CppCompileError: C++ compile error"


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("on", "on"), ("true", "on"), ("False", "off")])
def test_train_compile_takes_on_off_auto_and_booleans(typed_cfg, value, expected):
    assert typed_cfg(f"train.compile={value}").train.compile == expected


def test_train_compile_names_a_bad_value(typed_cfg):
    from mtp_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.compile: unknown value 'sometimes'; choose one of off, on, auto"):
        typed_cfg("train.compile=sometimes")


@pytest.mark.integration
def test_compiled_heads_train_to_the_eager_weights_and_a_short_auto_run_skips_the_compile(typed_cfg, tmp_path):
    """train.compile=on compiles the heads' forward in place: the same steps from the same start give
    the eager run's weights (to float32 rounding) under the same tensor names, and heads.json says it
    was compiled. train.compile=auto on a run too short to pay a compile back trains eager, untimed."""
    from safetensors.torch import load_file

    common = [*FAST, "heads.k=2", "trainer.max_steps=4"]
    run_train(typed_cfg(*common, "train.compile=on", f"paths.output_dir={tmp_path}/on"))
    run_train(typed_cfg(*common, "train.compile=auto", f"paths.output_dir={tmp_path}/auto"))
    on, auto = (json.loads((tmp_path / d / "heads.json").read_text())["recipe"]["compile"] for d in ("on", "auto"))
    assert on == {"used": True, "why": "train.compile=on"}
    assert auto == {"used": False, "why": "4 steps (trainer.max_steps / max_epochs) are too few to pay a compile back"}
    a, b = load_file(tmp_path / "on" / "heads.safetensors"), load_file(tmp_path / "auto" / "heads.safetensors")
    assert sorted(a) == sorted(b)
    moved = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert moved < 1e-5, moved


def test_compile_auto_counts_the_steps_of_an_epoch_bounded_run(typed_cfg):
    """trainer.max_steps=-1 (Lightning: unbounded, max_epochs decides) is a long run, not a short one."""
    from types import SimpleNamespace

    from mtp_train.pipeline.training import planned_steps

    dm = SimpleNamespace(train_dataloader=lambda: range(50))  # 50 batches an epoch
    assert planned_steps(typed_cfg("trainer.max_steps=120"), dm) == 120
    assert planned_steps(typed_cfg("trainer.max_steps=-1", "+trainer.max_epochs=3"), dm) == 150
    assert planned_steps(typed_cfg("trainer.max_steps=-1", "+trainer.max_epochs=3",
                                   "+trainer.accumulate_grad_batches=2"), dm) == 75
    assert planned_steps(typed_cfg("trainer.max_steps=-1"), dm) == 50_000  # Lightning's 1000 epochs
