"""mtp-eval: metrics against hand computations, the report's contract, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mtp_train import layout
from mtp_train.errors import MtpError
from mtp_train.evaluation.decode import decode
from mtp_train.evaluation.metrics import (
    ROUNDING_ULPS,
    backbone_nll,
    count_divergences,
    divergence_lines,
    divergence_margin,
    divergence_summary,
    first_divergence,
    repetition_ratio,
)
from tests.helpers import run_eval, wandb_offline_runs

CORE_KEYS = {"tau", "acceptance", "tokens_per_s", "speedup_vs_hf", "repetition_ratio", "backbone_nll",
             "greedy_match_rate", "identical_to_greedy", "n_prompts", "new_tokens", "speedup_vs_best_hf"}
FAST = ["debug=smoke", "trainer.max_steps=6", "trainer.val_check_interval=3"]


def test_repetition_ratio_and_first_divergence_by_hand():
    assert repetition_ratio([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 - 4 / 5)  # 5 grams, 4 unique
    assert repetition_ratio([1, 2, 3]) == 0.0 and repetition_ratio(list(range(10))) == 0.0
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_backbone_nll_equals_a_token_by_token_loop(tiny_backbone):
    bb = tiny_backbone
    prompt, out = [5, 9, 17, 3], [44, 2, 100]
    ref = []
    for i, t in enumerate(out):
        ids = torch.tensor([prompt + out[:i]])
        with torch.no_grad():
            logp = torch.log_softmax(bb.model(ids).logits[0, -1].double(), -1)
        ref.append(-float(logp[t]))
    assert backbone_nll(bb, prompt, out) == pytest.approx(sum(ref) / len(ref), rel=1e-4)


def test_divergence_margin_is_the_logit_gap_of_a_direct_forward(tiny_backbone):
    bb = tiny_backbone
    prompt = [5, 9, 17, 3]

    def logits_after(ids):
        with torch.no_grad():
            return bb.model(torch.tensor([ids])).logits[0, -1].float()

    greedy = []
    for _ in range(5):  # the tiny model's own greedy answer, by a plain loop
        greedy.append(int(logits_after(prompt + greedy).argmax()))
    at_2 = logits_after(prompt + greedy[:2])
    ranked = at_2.argsort(descending=True).tolist()
    worst = [*greedy[:2], ranked[-1], *greedy[3:]]  # a token the backbone ranks last, at position 2
    runner_up = [*greedy[:2], ranked[1]]  # greedy's second choice there, then the output stops

    m = divergence_margin(bb, prompt, greedy, worst)
    assert m["nats"] == pytest.approx(float(at_2[ranked[0]] - at_2[ranked[-1]]), abs=1e-4)
    eps = torch.finfo(torch.float32).eps
    assert m["ulps"] == pytest.approx(m["nats"] / (eps * max(abs(at_2[ranked[0]]), abs(at_2[ranked[-1]]), 1.0)),
                                      rel=1e-4)
    assert m["ulps"] > ROUNDING_ULPS  # a float32 forward resolves the tiny model's top and bottom apart
    gap = divergence_margin(bb, prompt, greedy, runner_up)["nats"]
    assert 0 <= gap <= m["nats"] and gap == pytest.approx(float(at_2[ranked[0]] - at_2[ranked[1]]), abs=1e-4)
    assert divergence_margin(bb, prompt, greedy, list(greedy)) is None  # identical
    assert divergence_margin(bb, prompt, greedy, greedy[:3]) is None  # stopped early: no competing token

    s = divergence_summary(bb, [prompt] * 4, [greedy] * 4, [greedy, worst, runner_up, greedy[:3]])
    assert s["divergences"] == 3 and s["divergences_judged"] == 2  # the early stop differs, unjudged
    assert s["divergence_margins"][0] is None and s["divergence_margins"][3] is None
    assert s["max_divergence_ulps"] == pytest.approx(m["ulps"]) and s["max_divergence_nats"] == pytest.approx(m["nats"])
    near = abs(s["divergence_margins"][2]["ulps"]) <= ROUNDING_ULPS
    assert s["divergences_at_near_ties"] == int(near) and s["divergences_greedy_led"] == 2 - int(near)
    assert s["divergences_mode_led"] == 0


def test_divergence_lines_tell_rounding_from_a_wrong_verification():
    def details(ulps, unjudged=0):
        return count_divergences([{"nats": u / 8, "ulps": u} for u in ulps] + [None] * unjudged, len(ulps) + unjudged)

    report = {"decoder": {"dtype": "bfloat16"}, "modes": {m: {"n_prompts": 20} for m in ("hf_generate", "verify", "tree", "dynamic")},
              "details": {"hf_generate": {}, "verify": details([0.0, -1.0, 2.9]), "tree": details([0.5, 40.0, -30.0], 1),
                          "dynamic": details([])}}
    assert report["details"]["tree"]["max_divergence_ulps"] == 40.0  # by size, sign kept
    lines = divergence_lines(report)
    assert len(lines) == 2  # nothing for a mode identical to greedy, nor for HF itself
    verify, tree = lines
    assert verify.startswith("verify: 3 of 20 outputs leave greedy's: 3 at near-ties") and "bfloat16" in verify
    assert "did not choose" not in verify and "+2.9 steps" in verify
    assert tree.startswith("tree: 4 of 20 outputs leave greedy's: 1 at near-ties")
    assert "1 where greedy's token led by more: this lossless mode accepted tokens the backbone did not choose" in tree
    assert "1 where the mode's token led by more: the greedy reference" in tree
    assert "1 where one output stops and the other goes on" in tree and "+40.0 steps" in tree


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config_rules import validate
    from tests.helpers import run_train

    root = tmp_path_factory.mktemp("eval")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(compose("config", overrides=[f"paths.root_dir={root}", f"paths.output_dir={root}/train",
                                                    *FAST, "heads.k=2"]))
    run_train(cfg)
    return root


def _eval_cfg(root, *overrides):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config_rules import validate

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return validate(compose("config", overrides=[
            f"paths.root_dir={root}", f"paths.output_dir={root}/eval", *FAST, "eval.n_prompts=3",
            "eval.max_new_tokens=12", "eval.rounds=3", f"eval.train_run={root}/train", *overrides]))


@pytest.mark.integration
def test_eval_report_has_the_contracted_keys_and_verify_is_lossless(trained_heads):
    root = trained_heads
    report = run_eval(_eval_cfg(root, "eval.modes=[greedy,verify,relaxed,adaptive]", "eval.budget=0", "eval.rounds=3"))
    saved = json.loads((root / "eval" / "eval_report.json").read_text())
    assert set(saved["modes"]) == {"hf_generate", "greedy", "verify", "relaxed", "adaptive"}
    for name, m in saved["modes"].items():
        assert set(m) == CORE_KEYS, name
        assert m["n_prompts"] == 3 and 3 <= m["new_tokens"] <= 36
    v = saved["modes"]["verify"]
    assert v["identical_to_greedy"] is True and v["greedy_match_rate"] == 1.0
    assert saved["details"]["verify"]["divergences"] == 0 and saved["divergence"] == []
    assert "divergences_judged" not in saved["details"]["relaxed"]  # lossy modes are not judged
    assert saved["modes"]["relaxed"]["identical_to_greedy"] is True  # budget 0 = verify
    assert len(v["acceptance"]) == 2
    assert saved["modes"]["greedy"]["backbone_nll"] == pytest.approx(v["backbone_nll"])
    assert saved["step_cost"] > 0 and saved["k"] == 2 and saved["sim_tau"] is not None
    hist = saved["details"]["verify"]["accept_hist"]
    assert len(hist) == 3 and sum(hist) > 0
    # tau counts what the steps committed: hist[n] steps took n drafts and the backbone's token
    assert v["tau"] == pytest.approx(sum((n + 1) * c for n, c in enumerate(hist)) / sum(hist))
    assert math.isclose(saved["modes"]["hf_generate"]["speedup_vs_hf"], 1.0)
    assert (root / "eval" / "speedup.png").stat().st_size > 0 and (root / "eval" / "acceptance.png").is_file()
    assert report["modes"]["verify"] == v
    # timing rounds (3 here): medians, spreads, a plausibility bound per drafting mode
    assert saved["rounds"] == 3 and saved["prompt_source"] == "validation" and isinstance(saved["flags"], list)
    for name, d in saved["details"].items():
        assert len(d["wall_s_rounds"]) == len(d["speedup_rounds"]) == 3, name
        assert d["speedup_spread"] == [min(d["speedup_rounds"]), max(d["speedup_rounds"])]
        assert saved["modes"][name]["speedup_vs_hf"] == pytest.approx(sorted(d["speedup_rounds"])[1])
        assert d["nondeterministic"] is False
        assert (d["plausible_max_speedup"] is None) == (name in ("hf_generate", "greedy")), name
    assert saved["details"]["hf_generate"]["speedup_rounds"] == [1.0, 1.0, 1.0]
    g = saved["modes"]["greedy"]["speedup_vs_hf"]
    assert saved["details"]["verify"]["plausible_max_speedup"] == pytest.approx(1.15 * v["tau"] * max(1.0, g))


@pytest.mark.integration
def test_tree_modes_are_lossless_and_the_report_says_what_this_machine_chose(trained_heads):
    root = trained_heads
    assert (root / "train" / "tree_stats.json").is_file()  # written by mtp-train beside the heads
    report = run_eval(_eval_cfg(root, "eval.modes=[greedy,verify,tree,dynamic,adaptive]", "eval.rounds=1",
                                "eval.tree_budgets=[3,5]", "eval.dtype=float32"))
    modes = report["modes"]
    for name in ("verify", "tree", "dynamic", "adaptive"):
        assert modes[name]["identical_to_greedy"] is True, name
    dec = report["decoder"]
    assert dec["dtype"] == "float32" and set(dec["matmul_layout"]) <= set("LTP{}:x0123456789' ,")
    costs = dec["verify_costs"]["costs"]
    trees = dec["trees"]
    assert costs["1"] == 1.0 and {str(r["nodes"] + 1) for r in trees["candidates"]} <= set(costs)
    labels = [r["label"] for r in trees["candidates"]]
    assert labels[0] == "chain2" and trees["static"] in labels and trees["rank_positions"] > 0
    for r in trees["candidates"]:
        assert r["cost"] == pytest.approx(r["verify_cost"] + r["draft_cost"])
        assert r["rate"] == pytest.approx(r["predicted_tau"] / r["cost"])
    best = max(trees["candidates"], key=lambda r: r["rate"])
    assert trees["static"] == best["label"]  # the size the measured costs favour
    assert set(report["hf_dtypes"]) == {"float32", "bfloat16"}
    fastest = max(report["hf_dtypes"].values())
    for m in modes.values():
        assert m["speedup_vs_best_hf"] == pytest.approx(m["speedup_vs_hf"] * report["hf_dtypes"]["float32"] / fastest)
    assert report["machine"]["cpu"] and (root / "eval" / "verify_costs.png").stat().st_size > 0
    ent = run_eval(_eval_cfg(root, "eval.modes=[greedy,adaptive]", "eval.adaptive_policy=entropy", "eval.rounds=1",
                             "eval.tree_budgets=[3]", "eval.dtype=float32", "force=true"))
    assert ent["modes"]["adaptive"]["identical_to_greedy"] is True
    assert len(ent["decoder"]["trees"]["entropy_trees"]) == 4


@pytest.mark.bad_input
@pytest.mark.integration
def test_mode_tree_without_rank_statistics_names_the_fix_and_mtp_train_records_them(trained_heads, tmp_path):
    import shutil

    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config_rules import validate
    from tests.helpers import run_train

    root = trained_heads
    old = tmp_path / "train"
    shutil.copytree(root / "train", old)
    (old / "tree_stats.json").unlink()
    with pytest.raises(MtpError, match=r"eval.modes: mode tree .*tree_stats.json.*mtp-train"):
        run_eval(_eval_cfg(root, f"eval.train_run={old}", "eval.modes=[tree]"))
    before = (old / "heads.safetensors").read_bytes()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(compose("config", overrides=[f"paths.root_dir={root}", f"paths.output_dir={old}",
                                                    *FAST, "heads.k=2"]))
    metrics = run_train(cfg)
    assert (old / "tree_stats.json").is_file() and "val/sim_tau_tree" in metrics
    assert (old / "heads.safetensors").read_bytes() == before  # validation only


@pytest.mark.bad_input
@pytest.mark.integration
def test_eval_bad_inputs_name_the_problem(trained_heads, tmp_path):
    root = trained_heads
    empty = tmp_path / "p.jsonl"
    empty.write_text('{"prompt": "hi"}\n{"prompt": "  "}\n')
    with pytest.raises(MtpError, match=r"p.jsonl, line 2: empty prompt"):
        run_eval(_eval_cfg(root, f"eval.prompts={empty}"))
    none = tmp_path / "none.jsonl"
    none.write_text("\n")
    with pytest.raises(MtpError, match="no prompts"):
        run_eval(_eval_cfg(root, f"eval.prompts={none}"))
    with pytest.raises(MtpError, match="eval.train_run"):
        run_eval(_eval_cfg(root, "eval.train_run=null"))
    bad = tmp_path / "heads"
    bad.mkdir()
    (bad / "heads.json").write_text((root / "train" / "heads.json").read_text())
    (bad / "heads.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(MtpError, match="heads.safetensors: not a readable safetensors"):
        run_eval(_eval_cfg(root, f"eval.train_run={bad}"))


@pytest.mark.integration
def test_over_long_prompts_are_skipped_and_counted(trained_heads, tmp_path):
    root = trained_heads
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "short one"}\n{"prompt": "' + "long " * 200 + '"}\n')
    report = run_eval(_eval_cfg(root, f"eval.prompts={f}", "eval.max_prompt_tokens=200", "eval.modes=[greedy]"))
    assert report["skipped_prompts"] == 1 and report["modes"]["greedy"]["n_prompts"] == 1


@pytest.mark.integration
def test_eval_logs_its_table_to_wandb_offline(trained_heads, monkeypatch):
    root = trained_heads
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = _eval_cfg(root, "logger=wandb", "eval.modes=[greedy,verify]", "eval.n_prompts=1")
    run_eval(cfg)
    runs = list((root / "eval" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    blob = b"".join(f.read_bytes() for f in runs[0].rglob("*.wandb"))
    for key in (b"eval/report", b"eval/verify/tau", b"eval/speedup", b"eval/step_cost"):
        assert key in blob, key
    (record,) = wandb_offline_runs(root / "eval")
    assert (record["name"], record["group"], record["job_type"]) == (f"{cfg.experiment_name}-eval", "", "eval")


@pytest.mark.integration
def test_mtp_clp_then_eval_with_clp_gate_and_clp_verify(trained_heads, monkeypatch):
    import shutil

    from mtp_train.pipeline.clp_run import run_clp

    root = trained_heads
    clp_args = ["clp.label_source=decode", "clp.n_prompts=6", "clp.shard_prompts=3", "clp.max_new_tokens=16", "clp.epochs=3",
                "clp.calib_prompts=2", "clp.thresholds=[0.9,0.5]", "eval.max_new_tokens=12",
                f"clp.train_run={root}/train"]
    cfg = _eval_cfg(root, *clp_args, f"paths.output_dir={root}/clp")
    res = run_clp(cfg)
    assert sum(res["label"]["label_histogram"]) == res["label"]["rows"] > 0
    assert set(res["fit"]) == {"clp", "gate"} and set(res["calibrate"]) == {"clp", "gate"}
    meta = json.loads((root / "clp" / "clp" / "predictor.json").read_text())
    assert meta["parameters"] == 64 * 3 + 3 and meta["threshold"] in (0.9, 0.5, 1.0) and "calibration" in meta
    # a rerun skips every finished stage (and keeps their wall times); other thresholds recalibrate only
    times = json.loads((root / "clp" / "stage_times.json").read_text())
    again = run_clp(cfg)
    assert again["label"] == res["label"]
    assert all(r["skipped"] for stage in ("fit", "calibrate") for r in again[stage].values())
    assert json.loads((root / "clp" / "stage_times.json").read_text()) == times
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    retuned = run_clp(_eval_cfg(root, *clp_args[:-1], "clp.thresholds=[0.9,0.6]", f"clp.train_run={root}/train",
                                f"paths.output_dir={root}/clp", "logger=wandb"))
    assert all(r["skipped"] for r in retuned["fit"].values())
    assert not any(r["skipped"] for r in retuned["calibrate"].values())
    (record,) = wandb_offline_runs(root / "clp")  # with logger=wandb, mtp-clp is a `clp` job
    assert record["job_type"] == "clp" and record["name"].endswith("-clp")
    eval_args = ["eval.modes=[greedy,clp,gate,clp+verify]", f"eval.clp_run={root}/clp"]
    report = run_eval(_eval_cfg(root, *eval_args))
    import mtp_train.evaluation.runner as runner_mod

    def no_decoding(*a, **k):
        raise AssertionError("a finished evaluation decoded again")

    with monkeypatch.context() as m:
        m.setattr(runner_mod, "run_modes", no_decoding)
        assert run_eval(_eval_cfg(root, *eval_args)) == report  # same inputs: the saved report
        with pytest.raises(AssertionError, match="decoded again"):  # another setting measures again
            run_eval(_eval_cfg(root, *eval_args, "eval.delta=0.2"))
    assert report["modes"]["clp+verify"]["identical_to_greedy"] is True
    assert set(report["modes"]["clp"]) == CORE_KEYS
    _check_pipeline_report(root, report)
    assert report["predictors"]["gate"]["parameters"] > 100 * report["predictors"]["clp"]["parameters"]
    # under a deadline, a predictor calibration left at 1.0 (commits nothing) is listed but not decoded
    import time

    calibrated = report["predictors"]["clp"]["calibrated"]
    timed = run_eval(_eval_cfg(root, "eval.modes=[greedy,clp]", f"eval.clp_run={root}/clp", "eval.rounds=1",
                               f"budget.deadline={time.time() + 3600}", f"paths.output_dir={root}/eval-clp-dl"))
    assert ("clp" in timed["modes"]) is calibrated and timed["predictors"]["clp"]["calibrated"] is calibrated
    assert any("not calibrated" in c for c in timed["sized_to_deadline"]["cut"]) is not calibrated
    sized = timed["sized_to_deadline"]  # "as asked" is priced before the drop: clp's decodes included
    assert (sized["predicted_full_s"] > sized["predicted_s"]) is not calibrated
    from mtp_train.evaluation.runner import QUICK_PROBE_ROUNDS

    assert timed["decoder"]["verify_costs"]["rounds"] > QUICK_PROBE_ROUNDS  # time to spare: the full probes
    # a deadline the shortest decodes overrun: the probes are timed in fewer rounds too
    tight = run_eval(_eval_cfg(root, "eval.modes=[verify]", "eval.rounds=1", f"budget.deadline={time.time() + 20}",
                               f"paths.output_dir={root}/eval-tight"))
    assert any(c.startswith("still") for c in tight["sized_to_deadline"]["cut"])
    assert tight["decoder"]["verify_costs"]["rounds"] == QUICK_PROBE_ROUNDS
    assert tight["decoder"]["trees"]["draft_rounds"] == QUICK_PROBE_ROUNDS
    # under a deadline mtp-clp calibrates only the predictors of modes the evaluation decodes (the gate's
    # thresholds would be decodes nothing reads), and says why
    dl = run_clp(_eval_cfg(root, *clp_args, "eval.modes=[verify,clp]", f"budget.deadline={time.time() + 3600}",
                           f"paths.output_dir={root}/clp_dl"))
    assert set(dl["fit"]) == {"clp", "gate"} and not dl["calibrate"]["clp"]["skipped"]
    assert "decodes no mode" in dl["calibrate"]["gate"]["not_calibrated"]
    gate = json.loads((root / "clp_dl" / "gate" / "predictor.json").read_text())
    assert gate["calibrated"] is False and gate["threshold"] == 1.0 and "calibration" not in gate
    assert gate["not_calibrated"] == dl["calibrate"]["gate"]["not_calibrated"]  # the report says why
    calibrated = json.loads((root / "clp_dl" / "clp" / "predictor.json").read_text())
    assert "calibration" in calibrated and "not_calibrated" not in calibrated
    # a predictor calibrated for other settings, then left uncalibrated by the deadline, loses that
    # threshold (mtp-eval would decode it as calibrated)
    assert "calibration" in json.loads((root / "clp" / "clp" / "predictor.json").read_text())
    skipped = run_clp(_eval_cfg(root, *clp_args[:-1], "clp.thresholds=[0.7]", f"clp.train_run={root}/train",
                                "stage=calibrate", "eval.modes=[verify]", f"budget.deadline={time.time() + 3600}",
                                f"paths.output_dir={root}/clp"))
    assert all(r["skipped"] and r["not_calibrated"] for r in skipped["calibrate"].values())
    for kind in ("clp", "gate"):
        meta = json.loads((root / "clp" / kind / "predictor.json").read_text())
        assert meta["calibrated"] is False and meta["threshold"] == 1.0 and "calibration" not in meta
        assert meta["not_calibrated"] == skipped["calibrate"][kind]["not_calibrated"]
    # eval.span_threshold maps the trade-off at a threshold of one's choosing; clp+verify stays lossless
    report = run_eval(_eval_cfg(root, "eval.modes=[greedy,clp,clp+verify]", f"eval.clp_run={root}/clp",
                                "eval.span_threshold=0.05"))
    assert report["predictors"]["clp"]["threshold"] == 0.05 == report["predictors"]["clp+verify"]["threshold"]
    assert report["modes"]["clp+verify"]["identical_to_greedy"] is True
    # labels made with other heads are refused by the fit stage
    other = root / "other"
    shutil.copytree(root / "train", other)
    from safetensors.torch import load_file, save_file

    state = load_file(str(other / "heads.safetensors"))
    save_file({n: t + 1e-3 for n, t in state.items()}, str(other / "heads.safetensors"))
    from mtp_train.artifacts import file_sha256  # other heads, as training would have recorded them

    meta = json.loads((other / "heads.json").read_text())
    (other / "heads.json").write_text(json.dumps({**meta, "weights_sha256": file_sha256(other / "heads.safetensors")}))
    with pytest.raises(MtpError, match="another heads checkpoint"):
        run_clp(_eval_cfg(root, *clp_args[:-1], f"clp.train_run={other}", f"paths.output_dir={root}/clp",
                          "stage=fit"))
    # and a predictor fitted for other heads is neither recalibrated nor used with these
    with pytest.raises(MtpError, match=r"clp: fitted on the labels of other heads than clp.train_run="):
        run_clp(_eval_cfg(root, *clp_args[:-1], "clp.thresholds=[0.7]", f"clp.train_run={other}",
                          f"paths.output_dir={root}/clp", "stage=calibrate"))
    with pytest.raises(MtpError, match=r"^eval.clp_run: .* was fitted on the acceptance of other heads"):
        run_eval(_eval_cfg(root, "eval.modes=[greedy,clp]", f"eval.train_run={other}", f"eval.clp_run={root}/clp",
                           f"paths.output_dir={root}/eval_other"))
    # the report judges them as mtp-eval does: fitted on other heads, so not calibrated for these (it
    # said "calibrated yes" before, hostile round 3)
    from mtp_train.report import _predictor_metas

    other_sha, other_heads = file_sha256(other / "heads.safetensors"), json.loads((other / "heads.json").read_text())
    metas = _predictor_metas(root / "clp", other_heads, other_sha)
    assert set(metas) == {"clp", "gate"}
    assert all(m["calibrated"] is False and "fitted on other heads" in m["problem"] for m in metas.values())
    ours = json.loads((root / "train" / "heads.json").read_text())
    assert not any("problem" in m for m in _predictor_metas(root / "clp", ours, ours["weights_sha256"]).values())
    # mtp-clp for the other heads refitting clp only removes the gate fitted on the earlier heads (it
    # stayed beside the new clp, hostile round 3)
    run_clp(_eval_cfg(root, *clp_args[:-1], "clp.kinds=[clp]", f"clp.train_run={other}", f"paths.output_dir={root}/clp"))
    assert not (root / "clp" / "gate").exists()
    metas = _predictor_metas(root / "clp", other_heads, other_sha)
    assert set(metas) == {"clp"} and "problem" not in metas["clp"]


@pytest.mark.integration
def test_under_a_deadline_each_kind_asks_room_for_its_next_threshold_and_the_later_kinds_first(trained_heads,
                                                                                             monkeypatch):
    """The i-th of n kinds asks room for P * (n - i) decodes (P calibration prompts): its own next
    threshold and the first threshold of every kind after it; the shared greedy reference is done."""
    import time

    import mtp_train.pipeline.clp_run as clp_run

    root, asked = trained_heads, []
    real = clp_run.sweep_rule

    def spy(bounds, room=None, next_decodes=0):
        asked.append(next_decodes)
        assert room is not None  # the deadline's room is passed on
        return real(bounds, room, next_decodes)

    monkeypatch.setattr(clp_run, "sweep_rule", spy)
    args = ["clp.label_source=decode", "clp.n_prompts=6", "clp.shard_prompts=3", "clp.max_new_tokens=16",
            "clp.epochs=2", "clp.calib_prompts=2", "clp.thresholds=[0.9,0.5]", "eval.max_new_tokens=12",
            f"clp.train_run={root}/train", "eval.modes=[verify,clp,gate]", f"budget.deadline={time.time() + 3600}",
            f"paths.output_dir={root}/clp_room"]
    res = clp_run.run_clp(_eval_cfg(root, *args))
    assert not res["calibrate"]["clp"]["skipped"] and not res["calibrate"]["gate"]["skipped"]
    n = json.loads((root / "clp_room" / "clp" / "predictor.json").read_text())["calibration"]["n_prompts"]
    assert asked == [2 * n, n]


class _Killed(Exception):
    pass


def _deterministic_calibration(meta: dict) -> list:
    """What a calibration measured apart from wall time: per threshold, accepted length, repetition, NLL."""
    cal = meta["calibration"]
    keep = ("tau", "repetition_ratio", "backbone_nll")
    return [[round(r[k], 9) for k in keep] for r in [cal["greedy"], *cal["thresholds"]]]


@pytest.mark.bad_input
@pytest.mark.integration
def test_mtp_clp_killed_in_each_stage_reruns_to_the_uninterrupted_result(trained_heads, monkeypatch):
    """A kill in labelling (after one shard), fitting (after the first predictor) or calibration
    (after the first predictor) leaves nothing half-written; the rerun redoes only what is missing and
    ends where an uninterrupted run ends."""
    import mtp_train.clp as clp_mod
    import mtp_train.data.acceptance as labels_mod
    import mtp_train.evaluation.calibration as calibration_mod
    from mtp_train.pipeline.clp_run import run_clp

    root = trained_heads
    args = ["clp.label_source=decode", "clp.n_prompts=6", "clp.shard_prompts=2", "clp.max_new_tokens=12",
            "clp.epochs=2", "clp.calib_prompts=2", "clp.thresholds=[0.9,0.5]", "eval.max_new_tokens=10",
            f"clp.train_run={root}/train"]
    run_clp(_eval_cfg(root, *args, f"paths.output_dir={root}/clp_straight"))

    def dies_on_call(n, real):
        calls = []

        def wrapped(*a, **k):
            calls.append(1)
            if len(calls) == n:
                raise _Killed
            return real(*a, **k)
        return wrapped

    def counting(real, calls):
        def wrapped(*a, **k):
            calls.append(1)
            return real(*a, **k)
        return wrapped

    cases = {"label": (labels_mod, "publish_dir", 2), "fit": (clp_mod, "save_predictor", 2),
             "calibrate": (calibration_mod, "sweep_thresholds", 2)}
    for stage, (module, name, n) in cases.items():
        out = root / f"clp_killed_in_{stage}"
        with monkeypatch.context() as m:
            m.setattr(module, name, dies_on_call(n, getattr(module, name)))
            with pytest.raises(_Killed):
                run_clp(_eval_cfg(root, *args, f"paths.output_dir={out}"))
        if stage == "label":
            assert not (out / layout.LABELS).exists()  # one of three shards done, kept for the rerun
            finished = [p.name for p in layout.shards_dir(out / layout.LABELS).iterdir() if p.is_dir() and ".tmp-" not in p.name]
            assert finished == ["00000"]
        elif stage == "fit":
            assert (out / "clp" / "predictor.safetensors").is_file() and not (out / "gate").exists()
        else:
            assert "calibration" in json.loads((out / "clp" / "predictor.json").read_text())
            assert "calibration" not in json.loads((out / "gate" / "predictor.json").read_text())
        decodes, published = [], []
        with monkeypatch.context() as m:
            m.setattr(calibration_mod, "sweep_thresholds", counting(calibration_mod.sweep_thresholds, decodes))
            m.setattr(labels_mod, "publish_dir", counting(labels_mod.publish_dir, published))
            again = run_clp(_eval_cfg(root, *args, f"paths.output_dir={out}"))
        if stage == "label":  # the two missing shards, then the labels dataset
            assert len(published) == 3
        if stage == "calibrate":  # the first predictor's calibration was finished: only the gate's runs
            assert again["calibrate"]["clp"]["skipped"] and not again["calibrate"]["gate"]["skipped"]
            assert len(decodes) == 1
        if stage == "fit":
            assert again["fit"]["clp"]["skipped"] and not again["fit"]["gate"].get("skipped")
        for kind in ("clp", "gate"):
            a = (root / "clp_straight" / kind / "predictor.safetensors").read_bytes()
            assert (out / kind / "predictor.safetensors").read_bytes() == a, (stage, kind)
            ma = json.loads((root / "clp_straight" / kind / "predictor.json").read_text())
            mb = json.loads((out / kind / "predictor.json").read_text())
            assert mb["fit"] == ma["fit"] and mb["label_histogram"] == ma["label_histogram"], (stage, kind)
            assert _deterministic_calibration(mb) == _deterministic_calibration(ma), (stage, kind)
            # and so is the threshold kept (picked by tokens per step, not by a timing)
            assert (mb["threshold"], mb["calibrated"]) == (ma["threshold"], ma["calibrated"]), (stage, kind)
        assert not layout.shards_dir(out / layout.LABELS).exists()
        assert not [p for p in out.rglob("*") if ".tmp-" in p.name or ".old-" in p.name], stage


@pytest.mark.bad_input
@pytest.mark.integration
def test_mtp_eval_killed_while_decoding_writes_no_report_and_the_rerun_decodes_the_same(trained_heads,
                                                                                        monkeypatch):
    from mtp_train.decoding import Decoder

    root = trained_heads
    args = ["eval.modes=[greedy,verify]", "eval.rounds=1"]
    straight = run_eval(_eval_cfg(root, *args, f"paths.output_dir={root}/eval_straight"))
    out = root / "eval_killed"
    real, calls = Decoder.generate, []

    def dying(self, *a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise _Killed
        return real(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(Decoder, "generate", dying)
        with pytest.raises(_Killed):
            run_eval(_eval_cfg(root, *args, f"paths.output_dir={out}"))
    assert not (out / "eval_report.json").exists() and not (out / "outputs.json").exists()
    import mtp_train.evaluation.render as render_mod

    with monkeypatch.context() as m:  # killed while writing what comes beside the report
        m.setattr(render_mod, "write_plots", lambda *a, **k: (_ for _ in ()).throw(_Killed()))
        with pytest.raises(_Killed):
            run_eval(_eval_cfg(root, *args, f"paths.output_dir={out}"))
    assert not (out / "eval_report.json").exists()  # the report, the mark of a finished run, comes last
    again = run_eval(_eval_cfg(root, *args, f"paths.output_dir={out}"))
    assert json.loads((out / "outputs.json").read_text()) == json.loads(
        (root / "eval_straight" / "outputs.json").read_text())
    for mode in ("greedy", "verify"):
        for key in ("tau", "acceptance", "identical_to_greedy", "new_tokens", "backbone_nll"):
            assert again["modes"][mode][key] == straight["modes"][mode][key], (mode, key)


def _check_pipeline_report(root, report):
    """mtp-report over train/, clp/ and eval/ of the run above: every section with its figures."""
    from mtp_train.report import write_report

    page = write_report(root).read_text()
    assert "heads: chained, k = 2" in page
    verify_free, spread = report["modes"]["clp"], report["details"]["clp"]["speedup_spread"]
    assert f"| clp | {verify_free['speedup_vs_hf']:.2f}x ({spread[0]:.2f}-{spread[1]:.2f}) |" in page
    assert "| clp | 195 |" in page.replace(",", "")  # the predictor table: 64 * 3 + 3 parameters
    assert "## Sample outputs" in page and "*clp*:" in page
    assert "| train |" in page and "| clp |" in page


@pytest.mark.integration
def test_labels_from_the_cache_are_the_labels_decoding_gives_on_the_same_greedy_text(trained_heads, tmp_path):
    """The cache route (teacher-forced drafts on the backbone's own greedy text) gives, at every
    step of a verify decode, the label m* that the decode itself records."""
    import numpy as np
    from datasets import load_from_disk

    from mtp_train.backbone import load_backbone
    from mtp_train.data.acceptance import labels_from_cache
    from mtp_train.decoding import Decoder
    from mtp_train.depth_targets import IGNORE
    from mtp_train.evaluation.prompts import held_out_prompts
    from mtp_train.heads.persist import load_heads
    from mtp_train.layout import labelled_dir

    root = trained_heads
    cfg = _eval_cfg(root)
    backbone = load_backbone(cfg.backbone)
    prompts = held_out_prompts(labelled_dir(cfg), "train")[:4]

    def decode_with_noise(scale: float):
        """Heads that err: trained heads are (almost) always right on the tiny language, so they are
        perturbed until the decodes accept different numbers of drafts (the noise only varies the labels)."""
        heads, _ = load_heads(root / "train", backbone)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn_like(p) * p.std() * scale)
        dec = Decoder(backbone, heads, eos_ids=[])
        rows, hidden, top, decoded = [], [], [], {}
        for i, prompt in enumerate(prompts):
            res = decode(dec, prompt, 24, "verify", trace=True)
            ids = torch.tensor(prompt + res.tokens)
            with torch.no_grad():
                h = backbone.hidden_states(ids[None])[0]
                top.append(backbone.logits(h).argmax(-1).numpy())
            hidden.append(h.numpy())
            rows.append({"input_ids": ids.tolist(), "labels": [IGNORE] * len(prompt) + res.tokens})
            decoded.update({(i, p): len(path) for p, drafts, _, path, _ in res.trace
                            if len(drafts) == heads.k and p + heads.k + 1 < len(ids)})
        return heads, rows, hidden, top, decoded

    for scale in (1.5, 2.0, 2.5, 0.75, 1.25, 1.75, 2.25, 2.75):
        heads, rows, hidden, top, decoded = decode_with_noise(scale)
        if len(set(decoded.values())) > 1:
            break

    class ArrayCache:
        manifest = {"config_hash": "test"}

        def row(self, split, i):
            return hidden[i]

        def stats(self, split, i):
            return {"top": top[i]}

    m = labels_from_cache(rows, ArrayCache(), "train", 0, heads, backbone, tmp_path / "labels",
                          {"heads_sha256": "x", "k": heads.k})
    ds = load_from_disk(str(tmp_path / "labels"))
    # which position each label row came from: its hidden state is that position's
    from_cache = {}
    for r in ds:
        i = r["prompt"]
        p = int(np.abs(hidden[i] - np.asarray(r["hidden"])).sum(-1).argmin())
        from_cache[(i, p)] = r["label"]
    assert decoded and set(decoded) <= set(from_cache)  # every decode step is a cache position
    assert {key: from_cache[key] for key in decoded} == decoded
    assert len(from_cache) > len(decoded)  # and the cache labels every position, not only steps
    assert sum(m["label_histogram"]) == len(ds) and len(set(decoded.values())) > 1


@pytest.mark.parametrize("split", ["validation", "train"])
@pytest.mark.integration
def test_cache_labels_come_from_the_split_clp_label_split_names(trained_heads, split):
    """The default labels the self-distilled validation rows, which the heads never trained on."""
    import dataclasses

    import numpy as np
    from datasets import load_from_disk

    from data_prep.stages import run_prep
    from mtp_train.backbone import load_backbone
    from mtp_train.layout import distilled_dir
    from mtp_train.pipeline.clp_run import distilled_cache, run_clp

    root = trained_heads
    over = ["clp.label_source=cache", f"clp.train_run={root}/train", "stage=label",
            f"paths.output_dir={root}/labels_{split}"] + ([] if split == "validation" else [f"clp.label_split={split}"])
    cfg = _eval_cfg(root, *over)
    run_prep(dataclasses.replace(cfg, stage="cache"))  # once: keyed by the data, reused after
    m = run_clp(cfg)["label"]
    assert m["split"] == split and m["n_prompts"] == len(load_from_disk(str(distilled_dir(cfg)))[split]) > 1
    ds = load_from_disk(str(root / f"labels_{split}" / layout.LABELS)).with_format("numpy")
    rows, cache, first = distilled_cache(cfg, load_backbone(cfg.backbone), split)
    for r in (0, len(ds) - 1):  # a label's hidden state is a position of that split's row
        h = np.asarray(cache.row(split, first + int(ds["prompt"][r])), dtype=np.float32)
        assert np.abs(h - ds["hidden"][r]).sum(-1).min() < 1e-4
    # tau is calibrated on prompts whose answers the predictor was not fitted on
    from mtp_train.depth_targets import IGNORE
    from mtp_train.evaluation.prompts import held_out_prompts
    from mtp_train.layout import labelled_dir
    from mtp_train.pipeline.clp_run import calibration_prompts, held_out_by_fit

    def prompt_of(row):
        return tuple(row["input_ids"][: next(i for i, v in enumerate(row["labels"]) if v != IGNORE)])

    calib = calibration_prompts(dataclasses.replace(cfg, clp=dataclasses.replace(cfg.clp, calib_prompts=50)),
                                load_backbone(cfg.backbone), m)
    if split == "validation":  # the prompts of the rows the fit held out (their labels), in order
        held = [p for p in range(m["n_prompts"]) if held_out_by_fit(p, cfg.clp.val_fraction)]
        assert 0 < len(held) < m["n_prompts"]
        assert [tuple(c) for c in calib] == [prompt_of(rows[first + p]) for p in held]
    else:
        assert calib == held_out_prompts(labelled_dir(cfg))[:50]


# ---------------------------------------------------------------------------------------------------
# timing rounds, the plausibility bound, prompts the project has never seen


def _result(tokens, accept_lengths):
    from mtp_train.decoding import DecodeResult

    return DecodeResult(tokens=tokens, steps=len(accept_lengths), accept_lengths=accept_lengths,
                        reached=[len(accept_lengths), 1], accepted=[1, 0])


def test_summarise_takes_the_median_over_rounds_and_reports_the_spread():
    from mtp_train.evaluation.metrics import summarise

    outs = [[1, 2, 3, 4], [5, 6]]
    res = [_result(outs[0], [2, 2]), _result(outs[1], [1, 1])]
    rep, det = summarise("verify", outs, res, [2.0, 1.0, 4.0], [2.0, 2.0, 2.0], None, [0.5, 0.5], 2,
                         round_tokens=[6, 6, 8])
    assert det["speedup_rounds"] == [1.0, 2.0, 0.5] and rep["speedup_vs_hf"] == 1.0  # median, not mean
    assert det["speedup_spread"] == [0.5, 2.0] and det["wall_s_rounds"] == [2.0, 1.0, 4.0]
    assert rep["tokens_per_s"] == 3.0 and det["wall_s"] == 2.0  # medians of [3, 6, 2] and of the walls
    assert rep["tau"] == 6 / 4 and rep["new_tokens"] == 6 and det["accept_hist"] == [2, 2, 0]
    one, d1 = summarise("greedy", outs, [], 3.0, 6.0, None, [0.5, 0.5], 2)  # plain numbers: one round
    assert one["speedup_vs_hf"] == 2.0 and d1["speedup_rounds"] == [2.0] and one["tokens_per_s"] == 2.0
    with pytest.raises(ValueError, match="rounds"):
        summarise("x", outs, [], [1.0, 1.0], [1.0], None, [0.5, 0.5], 2)


def test_plausibility_bound_flags_speedups_beyond_what_tau_allows():
    from mtp_train.evaluation.metrics import plausibility_flags

    def report(**speed_tau):
        modes = {n: {"speedup_vs_hf": s, "tau": t} for n, (s, t) in speed_tau.items()}
        return {"k": 3, "modes": {"hf_generate": {"speedup_vs_hf": 1.0, "tau": 1.0}, **modes},
                "details": {n: {"accept_hist": None if n == "hf_generate" else [1]} for n in ["hf_generate", *modes]}}

    r = report(clp=(4.33, 1.0), verify=(1.2, 1.1))  # no greedy: the bound uses 1.0 for it
    assert plausibility_flags(r) == ["clp: speedup 4.33x exceeds what tau 1.00 allows (<= 1.15x); "
                                     "the machine was probably loaded"]
    assert r["details"]["clp"]["plausible_max_speedup"] == pytest.approx(1.15)
    assert r["details"]["verify"]["plausible_max_speedup"] == pytest.approx(1.15 * 1.1)
    assert r["details"]["hf_generate"]["plausible_max_speedup"] is None
    # our greedy 1.3x faster than HF: a mode at tau 2 may reach 1.15 * 2 * 1.3 = 2.99x
    r = report(greedy=(1.3, 1.0), verify=(2.95, 2.0), relaxed=(3.1, 2.0))
    assert [f.split(":")[0] for f in plausibility_flags(r)] == ["relaxed"]
    assert r["details"]["greedy"]["plausible_max_speedup"] is None
    r = report(greedy=(0.5, 1.0), verify=(1.16, 1.0))  # a slow greedy does not lower the bound below tau
    assert plausibility_flags(r) == ["verify: speedup 1.16x exceeds what tau 1.00 allows (<= 1.15x); "
                                     "the machine was probably loaded"]


def _decoding_log(monkeypatch):
    """Record HF generate's and the decoder's calls in order (warm-up included) as mode names."""
    import mtp_train.evaluation.runner as runner_mod

    calls = []
    hf, dec = runner_mod.hf_generate, runner_mod.decode

    def logged_hf(*a, **k):
        calls.append("hf_generate")
        return hf(*a, **k)

    def logged_decode(decoder, prompt, max_new_tokens, name="greedy", **opts):
        calls.append(name)
        return dec(decoder, prompt, max_new_tokens, name, **opts)

    monkeypatch.setattr(runner_mod, "hf_generate", logged_hf)
    monkeypatch.setattr(runner_mod, "decode", logged_decode)
    return calls


def _tiny_run(root):
    from mtp_train.backbone import load_backbone
    from mtp_train.evaluation.prompts import held_out_prompts
    from mtp_train.heads.persist import load_heads
    from mtp_train.layout import labelled_dir

    cfg = _eval_cfg(root, "eval.modes=[greedy,verify]", "eval.warmup=0", "eval.rounds=2")
    backbone = load_backbone(cfg.backbone)
    heads, _ = load_heads(root / "train", backbone)
    return cfg, backbone, heads, held_out_prompts(labelled_dir(cfg))[:3]


@pytest.mark.integration
def test_rounds_rotate_the_order_so_no_mode_always_runs_first(trained_heads, monkeypatch):
    from mtp_train.evaluation.runner import round_order, run_modes

    cfg, backbone, heads, prompts = _tiny_run(trained_heads)
    calls = _decoding_log(monkeypatch)
    report, outputs = run_modes(backbone, heads, prompts, cfg.eval)
    names = ["hf_generate", "greedy", "verify"]
    assert len(calls) == 2 * 3 * 3  # 2 rounds x 3 prompts x (HF + 2 modes), no warm-up
    chunks = [calls[i: i + 3] for i in range(0, len(calls), 3)]
    expected = [round_order(names, i, r) for r in range(2) for i in range(3)]
    assert chunks == expected
    assert {c[0] for c in chunks} == set(names)  # each of them runs first somewhere
    assert [c[0] for c in chunks[:3]] != [c[0] for c in chunks[3:]]  # and the rounds differ
    for r in range(2):
        for i in range(3):
            assert sorted(round_order(names, i, r)) == sorted(names)
    for d in report["details"].values():
        assert len(d["wall_s_rounds"]) == 2 and all(w > 0 for w in d["wall_s_rounds"])
        assert d["nondeterministic"] is False
    assert report["rounds"] == 2 and report["details"]["hf_generate"]["speedup_rounds"] == [1.0, 1.0]
    assert outputs["verify"] == outputs["greedy"] and len(outputs["hf_generate"]) == 3


@pytest.mark.integration
def test_quick_probes_time_the_layouts_and_the_cost_curve_in_fewer_rounds(trained_heads, monkeypatch):
    import mtp_train.decoding.costs as costs_mod
    from mtp_train.evaluation.runner import QUICK_PROBE_ROUNDS, run_modes

    cfg, backbone, heads, prompts = _tiny_run(trained_heads)
    reps, measure = [], costs_mod.measure_matmuls

    def spy(dec, reps_=None, **kw):
        reps.append(kw.get("reps", reps_))
        return measure(dec, **kw)

    monkeypatch.setattr(costs_mod, "measure_matmuls", lambda dec, **kw: spy(dec, **kw))
    quick, _ = run_modes(backbone, heads, prompts[:1], cfg.eval, quick_probes=True)
    full, _ = run_modes(backbone, heads, prompts[:1], cfg.eval)
    assert reps == [QUICK_PROBE_ROUNDS, None]  # None: measure_matmuls' own default
    assert quick["decoder"]["verify_costs"]["rounds"] == QUICK_PROBE_ROUNDS < full["decoder"]["verify_costs"]["rounds"]
    assert quick["decoder"]["trees"]["draft_rounds"] == QUICK_PROBE_ROUNDS < full["decoder"]["trees"]["draft_rounds"]


@pytest.mark.integration
def test_a_later_round_that_decodes_other_tokens_is_marked_nondeterministic(trained_heads, monkeypatch):
    import mtp_train.evaluation.runner as runner_mod
    from mtp_train.evaluation.runner import run_modes

    cfg, backbone, heads, prompts = _tiny_run(trained_heads)
    dec, seen = runner_mod.decode, set()

    def flaky_verify(decoder, prompt, max_new_tokens, name="greedy", **opts):
        res = dec(decoder, prompt, max_new_tokens, name, **opts)
        key = (name, tuple(prompt))
        if name == "verify" and key in seen:  # the second time verify decodes a prompt: other tokens
            res.tokens = res.tokens[:-1] + [(res.tokens[-1] + 1) % 100]
        seen.add(key)
        return res

    monkeypatch.setattr(runner_mod, "decode", flaky_verify)
    report, outputs = run_modes(backbone, heads, prompts, cfg.eval)
    assert report["details"]["verify"]["nondeterministic"] is True
    assert report["details"]["greedy"]["nondeterministic"] is False
    assert report["modes"]["verify"]["identical_to_greedy"] is True  # outputs are round 1's
    assert outputs["verify"] == outputs["greedy"]


def _mode(speed, tau, rep=0.2, nll=0.6, same=True):
    return {"speedup_vs_hf": speed, "tau": tau, "repetition_ratio": rep, "backbone_nll": nll,
            "identical_to_greedy": same}


def test_print_table_shows_the_spread_and_the_flags(capsys):
    from mtp_train.evaluation.render import format_speedup, print_table

    m = _mode(1.21, 1.9) | {"tokens_per_s": 10.0, "acceptance": [0.5], "greedy_match_rate": 1.0}
    report = {"k": 1, "step_cost": 1.0, "modes": {"verify": m}, "rounds": 3,
              "details": {"verify": {"speedup_rounds": [1.15, 1.21, 1.3], "speedup_spread": [1.15, 1.3]}},
              "flags": ["verify: speedup 9.99x exceeds what tau 1.00 allows (<= 1.15x); the machine was probably loaded"]}
    assert format_speedup(m, report["details"]["verify"]) == "1.21x (1.15-1.30)"
    assert format_speedup(m, {"speedup_rounds": [1.21], "speedup_spread": [1.21, 1.21]}) == "1.21x"
    print_table(report)
    out = capsys.readouterr().out
    assert "1.21x (1.15-1.30)" in out and "the machine was probably loaded" in out


def test_prompt_messages_stop_before_the_first_answer_and_need_a_user_turn():
    from mtp_train.evaluation.prompts import prompt_messages

    sys_, user, ans = ({"role": r, "content": r} for r in ("system", "user", "assistant"))
    assert prompt_messages([sys_, user, ans, user, ans]) == [sys_, user]
    assert prompt_messages([user]) == [user]  # prompt-only
    assert prompt_messages([sys_, ans, user]) is None and prompt_messages([ans, user, ans]) is None


@pytest.mark.bad_input
@pytest.mark.integration
def test_unseen_prompts_on_the_tiny_data_source_are_an_error_naming_the_key(trained_heads):
    from mtp_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^eval.prompt_source: there are no unseen conversations"):
        run_eval(_eval_cfg(trained_heads, "eval.prompt_source=unseen"))


@pytest.mark.integration
def test_unseen_prompts_are_the_conversations_the_dataset_did_not_sample(tmp_path, monkeypatch):
    import random

    import mtp_train.data.template as template_mod
    from data_prep.stages import run_prep
    from mtp_train.backbone import load_backbone
    from mtp_train.data.template import render_prompt
    from mtp_train.evaluation.prompts import dataset_ids
    from mtp_train.layout import labelled_dir
    from mtp_train.pipeline.evaluation import eval_key, select_prompts

    rows = []
    for i in range(14):
        msgs = [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]
        if i % 3 == 0:
            msgs = [{"role": "system", "content": "Be brief."}, *msgs,
                    {"role": "user", "content": "And times two?"}, {"role": "assistant", "content": f"{4 * i}."}]
        rows.append({"id": f"conv-{i}", "messages": msgs})
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def cfg_of(*extra):
        from hydra import compose, initialize_config_dir

        from mtp_train.cli.common import CONF_DIR
        from mtp_train.config_rules import validate

        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return validate(compose("config", overrides=[
                f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}/eval", "backbone=tiny", "logger=none",
                "data=jsonl", f"data.path={src}", "data.max_conversations=8", "data.max_length=256",
                "eval.max_new_tokens=8", "eval.modes=[greedy]", "eval.rounds=1", *extra]))

    run_prep(cfg_of("stage=data"))
    seen = dataset_ids(labelled_dir(cfg_of()))
    assert len(seen) == 8 and seen < {r["id"] for r in rows}
    backbone = load_backbone(cfg_of().backbone)
    tok = backbone.tokenizer
    unseen = [r for r in rows if r["id"] not in seen]  # source order, then the seeded shuffle
    random.Random(0).shuffle(unseen)
    expected = [render_prompt(tok, r["messages"][: next(i for i, m in enumerate(r["messages"])
                                                        if m["role"] == "assistant")]) for r in unseen]
    prompts, skipped = select_prompts(cfg_of("eval.prompt_source=unseen", "eval.n_prompts=null"), backbone)
    assert prompts == expected and len(prompts) == 6 and skipped == 0
    assert not {tuple(p) for p in prompts} & {tuple(p) for p in select_prompts(cfg_of(), backbone)[0]}
    # only as many as needed are rendered; another seed, another order
    rendered = []
    real = template_mod.render_prompt
    monkeypatch.setattr(template_mod, "render_prompt", lambda t, m: rendered.append(m) or real(t, m))
    two, _ = select_prompts(cfg_of("eval.prompt_source=unseen", "eval.n_prompts=2"), backbone)
    assert two == expected[:2] and len(rendered) == 2
    monkeypatch.setattr(template_mod, "render_prompt", real)
    other, _ = select_prompts(cfg_of("eval.prompt_source=unseen", "eval.n_prompts=null", "seed=1"), backbone)
    assert sorted(other) == sorted(expected) and other != expected
    assert eval_key(cfg_of("eval.prompt_source=unseen")) != eval_key(cfg_of())
    # mtp-eval end to end: the report names the source; outputs.json holds exactly these prompts
    report = run_eval(cfg_of("eval.prompt_source=unseen", "eval.n_prompts=3"))
    assert report["prompt_source"] == "unseen" and report["modes"]["greedy"]["n_prompts"] == 3
    saved = json.loads((tmp_path / "eval" / "outputs.json").read_text())
    assert [r["prompt"] for r in saved] == [tok.decode(p) for p in expected[:3]]


@pytest.mark.parametrize("content,message", [
    (b'{"prompt": "caf\xe9 au lait"}\n', r"p.jsonl, line 2: not UTF-8 text \(byte 0xe9, the line's byte 16\)"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}\n', r"p.jsonl, line 2: message 0 has an unknown role 'wizard'"),
    (b'{"messages": [{"role": "user", "content": ["x"]}]}\n', r"p.jsonl, line 2: message 0 has no text content"),
    (b'{"messages": []}\n', r"p.jsonl, line 2: empty messages list"),
    (b'{"messages": [{"role": "assistant", "content": "hello"}]}\n', r"p.jsonl, line 2: no user message"),
])
@pytest.mark.bad_input
def test_a_bad_prompts_file_line_is_refused_naming_the_line(tiny_tokenizer, tmp_path, content, message):
    """Prompts are held to the data stage's rules: an unknown role is not rendered as
    `<|im_start|>wizard`, and bytes that are not UTF-8 are an error naming line and column."""
    from mtp_train.errors import DataError
    from mtp_train.evaluation.prompts import load_prompts_jsonl

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"messages": [{"from": "human", "value": "fine"}]}\n' + content)
    with pytest.raises(DataError, match=message):
        load_prompts_jsonl(path, tiny_tokenizer)
    path.write_bytes(b'{"messages": [{"from": "human", "value": "fine"}]}\n')
    assert len(load_prompts_jsonl(path, tiny_tokenizer)) == 1


@pytest.mark.bad_input
def test_prompt_files_are_read_by_the_data_stages_row_parsing(tiny_tokenizer, tmp_path):
    """A prompt file's rows take the shapes `data=jsonl` reads (ShareGPT's "conversations" too); a
    "response" is left out of the prompt; the data stage's refusals name the line."""
    from mtp_train.data.template import render_prompt
    from mtp_train.errors import DataError
    from mtp_train.evaluation.prompts import load_prompts_jsonl

    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "q"}, {"prompt": "q", "response": "a"}, {"conversations": [{"from": "human", "value": "q"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompts_jsonl(path, tiny_tokenizer) == [render_prompt(tiny_tokenizer, [{"role": "user", "content": "q"}])] * 3
    for row, message in (([1, 2], 'row without "prompt" or "messages"'),
                         ({"messages": [{"role": "user", "content": " "}]}, "empty prompt")):
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(DataError, match=f"p.jsonl, line 1: {message}"):
            load_prompts_jsonl(path, tiny_tokenizer)


@pytest.mark.parametrize("over,message", [
    (["eval.max_new_tokens=600"], r"^eval.max_new_tokens: 600 new tokens do not fit the backbone's context of 512"),
    (["eval.max_new_tokens=500"], r"^eval.max_new_tokens: the shortest prompt \(\d+ tokens\) \+ 500 new tokens "
                                  r"exceed the backbone's context of 512"),
    (["eval.max_prompt_tokens=5"], r"^eval.max_prompt_tokens: every prompt is longer than 5 tokens"),
    (["eval.max_new_tokens=1", "eval.max_prompt_tokens=4096", "LONG"],
     r"^eval.prompts: every prompt of eval.prompts=.* is as long as the backbone's context of 512 tokens"),
    (["eval.max_new_tokens=1", "DIR"], r"eval.prompts: .* is a directory; expected a JSONL file of prompts"),
])
@pytest.mark.bad_input
def test_when_no_prompt_fits_the_message_blames_the_setting_that_excluded_them(tiny_backbone, tmp_path,
                                                                              over, message):
    from mtp_train.errors import ConfigError, DataError
    from mtp_train.pipeline.evaluation import select_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "count ' + "count " * 600 + '"}\n' if "LONG" in over else
                 '{"prompt": "short one"}\n{"prompt": "a little longer one"}\n')
    if "DIR" in over:
        f = tmp_path
    over = [o for o in over if o not in ("LONG", "DIR")]
    with pytest.raises((ConfigError, DataError), match=message):
        select_prompts(_eval_cfg(tmp_path, f"eval.prompts={f}", *over), tiny_backbone)


@pytest.mark.integration
def test_sampled_modes_report_their_warpers_repeat_with_their_seed_and_leave_greedy_untouched(trained_heads):
    root = trained_heads
    greedy_only = run_eval(_eval_cfg(root, "eval.modes=[greedy,verify,tree]", "eval.rounds=2", "force=true"))
    greedy_outputs = json.loads((root / "eval" / layout.OUTPUTS).read_text())
    sampled = ("eval.modes=[greedy,verify,tree]", "eval.rounds=2", "eval.sampling.temperatures=[0,0.7]",
               "eval.sampling.samples=2", "eval.sampling.top_p=0.9")
    report = run_eval(_eval_cfg(root, *sampled, "force=true"))
    # temperature 0 is the greedy run, bit for bit
    assert json.loads((root / "eval" / layout.OUTPUTS).read_text()) == greedy_outputs
    for name in ("greedy", "verify", "tree"):
        assert report["modes"][name]["tau"] == greedy_only["modes"][name]["tau"]
    assert set(report["sampled"]) == {"t0.7"}
    run = report["sampled"]["t0.7"]
    assert set(run["modes"]) == {"hf_generate", "greedy", "verify", "tree"}
    for name, m in run["modes"].items():
        assert (m["temperature"], m["top_k"], m["top_p"], m["min_p"]) == (0.7, 0, 0.9, None), name
        assert m["samples_per_prompt"] == 2 and m["n_prompts"] == 3
        assert {"tau", "speedup_vs_hf", "acceptance", "backbone_nll", "repetition_ratio"} <= set(m)
        d = run["details"][name]
        assert len(d["speedup_rounds"]) == 2 and m["speedup_vs_hf"] == pytest.approx(
            sorted(d["speedup_rounds"])[0] / 2 + sorted(d["speedup_rounds"])[1] / 2)
    assert run["modes"]["verify"]["tau"] >= 1.0 and len(run["modes"]["verify"]["acceptance"]) == 2
    assert "nll_z_vs_hf" in run["modes"]["tree"] and "nll_z_vs_hf" not in run["modes"]["hf_generate"]
    assert (root / "eval" / layout.SAMPLING_PNG).stat().st_size > 0
    again = run_eval(_eval_cfg(root, *sampled, "force=true"))  # the same seeds: the same samples
    assert again["sampled"]["t0.7"]["modes"]["tree"]["tau"] == run["modes"]["tree"]["tau"]
    assert again["sampled"]["t0.7"]["modes"]["tree"]["new_tokens"] == run["modes"]["tree"]["new_tokens"]


@pytest.mark.integration
def test_an_evaluation_past_its_deadline_is_cut_and_says_so(trained_heads):
    import time

    root = trained_heads
    cfg = _eval_cfg(root, "eval.modes=[verify,tree,relaxed]", "eval.sampling.temperatures=[1.0]", "eval.rounds=1",
                    "eval.max_new_tokens=40", f"budget.deadline={time.time() - 60}", f"paths.output_dir={root}/eval-dl")
    report = run_eval(cfg)
    sized = report["sized_to_deadline"]
    assert sized["left_s"] < -59 and sized["predicted_s"] < sized["predicted_full_s"]
    assert set(report["modes"]) == {"hf_generate", "verify", "tree"} and report["max_new_tokens"] == 16
    assert "T=[1.0]" in sized["cut"][0] and "relaxed" in sized["cut"][1] and "sampled" not in report
    # the same evaluation without a deadline is another evaluation, not this cut one
    again = run_eval(_eval_cfg(root, "eval.modes=[verify]", "eval.rounds=1", "eval.max_new_tokens=40",
                               f"paths.output_dir={root}/eval-dl"))
    assert "sized_to_deadline" not in again and again["max_new_tokens"] == 40


@pytest.mark.integration
def test_a_sampled_run_is_decided_by_the_greedy_decodes_measured_time(trained_heads, monkeypatch):
    """Under a deadline the probe says is far enough, the sampled run is still priced from the greedy
    decodes just made: priced out (a huge overhead), it is cut and the report says why; priced in, it runs."""
    import time

    import mtp_train.evaluation.runner as runner

    root = trained_heads
    common = ["eval.modes=[verify]", "eval.sampling.temperatures=[1.0]", "eval.rounds=1", "eval.max_new_tokens=12",
              f"budget.deadline={time.time() + 3600}"]
    monkeypatch.setattr(runner, "SAMPLED_OVERHEAD", 1e6)
    report = run_eval(_eval_cfg(root, *common, f"paths.output_dir={root}/eval-fit"))
    sized = report["sized_to_deadline"]
    assert "sampled" not in report and sized["sampled_fit"]["cut"] == [1.0]
    assert "from the greedy decodes" in sized["cut"][-1] and "T=[1.0]" in sized["cut"][-1]
    monkeypatch.setattr(runner, "SAMPLED_OVERHEAD", 1.1)
    kept = run_eval(_eval_cfg(root, *common, "force=true", f"paths.output_dir={root}/eval-fit"))
    assert set(kept["sampled"]) == {"t1.0"} and kept["sized_to_deadline"]["sampled_fit"]["cut"] == []


@pytest.mark.bad_input
@pytest.mark.integration
def test_rank_statistics_of_other_heads_are_refused(trained_heads, tmp_path):
    """A tree_stats.json copied from k=3 heads beside these k=2 heads grew a wrong tree silently
    (hostile round 5): refused naming the file and both depths."""
    import shutil

    from mtp_train.trees import RankStats

    root = trained_heads
    other = tmp_path / "train"
    shutil.copytree(root / "train", other)
    RankStats(k=3, max_rank=RankStats.rank_cap(3)).save(other / "tree_stats.json")
    with pytest.raises(MtpError, match=r"tree_stats\.json: rank statistics of k=3 heads, but these heads have k=2"):
        run_eval(_eval_cfg(root, f"eval.train_run={other}", "eval.modes=[tree]", "eval.rounds=1",
                           f"paths.output_dir={tmp_path}/eval"))


@pytest.mark.bad_input
@pytest.mark.integration
def test_validation_prompts_of_a_re_split_dataset_are_refused(trained_heads, tmp_path):
    """After `mtp-prep data.seed=1` re-split the data, eval's "held-out" validation prompts included
    rows the heads trained on (hostile round 5): refused, naming the key and the way out."""
    import shutil

    from mtp_train.errors import ConfigError
    from mtp_train.pipeline.evaluation import run_eval as eval_only
    from tests.helpers import prepare_tiny

    root = tmp_path / "r"
    shutil.copytree(trained_heads, root)
    prepare_tiny(_eval_cfg(root, "data.seed=1"))  # the same directory, another split
    with pytest.raises(ConfigError, match="eval.prompt_source: .* is not the split these heads trained on"):
        eval_only(_eval_cfg(root, "eval.modes=[verify]", "eval.rounds=1"))
    shutil.rmtree(root / "eval", ignore_errors=True)
    prepare_tiny(_eval_cfg(root))  # the heads' own split again: decodes
    assert eval_only(_eval_cfg(root, "eval.modes=[verify]", "eval.rounds=1"))["modes"]["verify"]
