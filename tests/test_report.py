"""mtp-report: the page a pipeline run leaves (runs/demo/report.md), its target rows, and the
lines printed at the end of `make demo`."""

from __future__ import annotations

import json

import pytest

from mtp_train.errors import MtpError


def _mode(speed, tau, rep=0.2, nll=0.6, same=True):
    return {"speedup_vs_hf": speed, "tau": tau, "repetition_ratio": rep, "backbone_nll": nll,
            "identical_to_greedy": same}


@pytest.mark.integration
def test_report_training_curves_from_the_csv_logger(tmp_path):
    from mtp_train.report import training_curves, write_report

    run = tmp_path / "train" / "csv" / "version_0"
    run.mkdir(parents=True)
    lines = ["epoch,step,train/loss_step,val/loss,val/sim_tau,val/agree_d1,val/agree_d2"]
    lines += [f"0,{s},{1 - s / 100},,,," for s in range(0, 40, 10)]
    lines += ["0,39,,0.7,1.3,0.2,0.1"]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    png = training_curves(tmp_path / "train", tmp_path / "curves.png")
    assert png.stat().st_size > 5000
    (tmp_path / "empty").mkdir()
    with pytest.raises(MtpError, match="nothing to report"):
        write_report(tmp_path / "empty")


def test_report_targets_say_met_only_when_every_condition_holds():
    from mtp_train.report import target_rows

    def mode(speed, tau, rep=0.2, nll=0.6, same=True):
        return {"speedup_vs_hf": speed, "tau": tau, "repetition_ratio": rep, "backbone_nll": nll,
                "identical_to_greedy": same}

    good = {"modes": {"greedy": mode(1.0, 1.0), "verify": mode(1.5, 2.0), "clp": mode(1.45, 1.8, 0.21, 0.65)}}
    assert [met for *_, met in target_rows(good, 29 * 60)] == [True, True, True, True]
    bad = {"modes": {"greedy": mode(1.0, 1.0), "verify": mode(1.5, 2.0, same=False),
                     "clp": mode(1.6, 1.9, 0.25, 0.65)}}  # lossy "verify"; clp repeats +0.05
    rows = target_rows(bad, 31 * 60)
    assert [met for *_, met in rows] == [False, True, False, False]
    assert "NOT identical" in rows[0][2] and "+0.050" in rows[2][2] and "near-ties" not in rows[0][2]
    rounding = {**bad, "decoder": {"dtype": "bfloat16"}, "details": {"verify": {"divergences": 3, "divergences_at_near_ties": 3}}}
    rows = target_rows(rounding, None)
    assert rows[0][3] is False and "NOT identical (3 differ, all at near-ties: bfloat16 rounding)" in rows[0][2]
    rounding["details"]["verify"]["divergences"] = 4  # one more, not a near-tie: no rounding excuse
    assert target_rows(rounding, None)[0][2].endswith("output NOT identical")
    assert target_rows(bad, None, {"max_repetition_increase": 0.06})[2][3] is True  # the run's own bounds


def test_report_targets_never_met_by_a_flagged_mode_or_an_uncalibrated_predictor():
    from mtp_train.report import target_rows

    good = {"modes": {"greedy": _mode(1.0, 1.0), "verify": _mode(1.5, 2.0), "clp": _mode(1.45, 1.8, 0.21, 0.65)}}
    assert [met for *_, met in target_rows(good, None)] == [True, True, True]
    # verify at 3x with tau 2 on a machine where greedy is HF's speed: beyond 1.15 * 2 = 2.3x
    loaded = {"modes": {**good["modes"], "verify": _mode(3.0, 2.0)},
              "flags": ["verify: speedup 3.00x exceeds what tau 2.00 allows (<= 2.30x); the machine was probably loaded"]}
    rows = target_rows(loaded, None)
    assert [met for *_, met in rows] == [False, False, True] and "flagged" in rows[0][2]
    loaded.pop("flags")  # not flagged, but above the bound mtp-eval recorded for the mode
    loaded["details"] = {"verify": {"plausible_max_speedup": 2.3}}
    assert [met for *_, met in target_rows(loaded, None)] == [False, False, True]
    fast_clp = {"modes": {**good["modes"], "clp": _mode(4.33, 1.5, 0.2, 0.6)},
                "details": {"clp": {"plausible_max_speedup": 1.725}}}
    assert target_rows(fast_clp, None)[2][3] is False
    # clp whose predictor is not calibrated, or that commits nothing beyond greedy: never met
    uncal = {**good, "predictors": {"clp": {"parameters": 195, "threshold": 1.0, "calibrated": False}}}
    rows = target_rows(uncal, None)
    assert rows[2][2] == "not calibrated (accepts nothing)" and rows[2][3] is False
    meta_says = target_rows(good, None, predictors={"clp": {"calibrated": False}})  # predictor.json
    assert meta_says[2][2] == "not calibrated (accepts nothing)" and meta_says[2][3] is False
    assert target_rows(good, None, predictors={"clp": {"calibrated": True}})[2][3] is True
    idle = {"modes": {**good["modes"], "clp": _mode(1.45, 1.005)},
            "predictors": {"clp": {"calibrated": True}}}
    rows = target_rows(idle, None)
    assert rows[2][2] == "not calibrated (accepts nothing)" and rows[2][3] is False


def _flagged_run(tmp_path) -> dict:
    """An eval report with timing rounds and a flagged clp, written as <tmp>/eval/eval_report.json."""

    def details(rounds, bound):
        return {"speedup_rounds": rounds, "speedup_spread": [min(rounds), max(rounds)],
                "wall_s_rounds": [1.0] * len(rounds), "plausible_max_speedup": bound, "accept_hist": [1]}

    modes = {"hf_generate": _mode(1.0, 1.0), "greedy": _mode(1.0, 1.0), "verify": _mode(1.21, 1.9),
             "clp": _mode(4.33, 1.5)}
    for m in modes.values():
        m.update(tokens_per_s=10.0, acceptance=[0.5], greedy_match_rate=1.0, n_prompts=2, new_tokens=20)
    flag = "clp: speedup 4.33x exceeds what tau 1.50 allows (<= 1.73x); the machine was probably loaded"
    report = {"modes": modes, "k": 1, "step_cost": 1.05, "sim_tau": None, "rounds": 3, "flags": [flag],
              "prompt_source": "unseen", "max_new_tokens": 10, "elapsed_s": 5.0,
              "predictors": {"clp": {"parameters": 195, "threshold": 0.5, "calibrated": True}},
              "details": {"hf_generate": details([1.0, 1.0, 1.0], None), "greedy": details([0.9, 1.0, 1.1], None),
                          "verify": details([1.15, 1.21, 1.30], 2.19), "clp": details([4.0, 4.33, 4.5], 1.725)}}
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval_report.json").write_text(json.dumps(report))
    return report


@pytest.mark.integration
def test_report_page_shows_spread_and_flags_and_summary_says_not_met(tmp_path):
    from mtp_train.report import summary, write_report

    report = _flagged_run(tmp_path)
    flag = report["flags"][0]
    page = write_report(tmp_path).read_text()
    assert "| verify | 1.21x (1.15-1.30) |" in page and "| hf_generate | 1.00x (1.00-1.00) |" in page
    assert f"- {flag}" in page and "unseen prompts" in page and "median of 3 timing rounds" in page
    assert "(tau 1.50), speedup implausible (flagged) | **no** |" in page
    text = summary(tmp_path)
    assert f"flag: {flag}" in text and "1.21x (1.15-1.30)" in text
    assert "target NOT met: clp" in text and "target met: clp" not in text
    assert "not greedy's" not in page and "not identical to greedy" not in text  # a report from before the check
    report["divergence"] = ["verify: 2 of 2 outputs leave greedy's: 2 at near-ties (within 8 rounding steps)"]
    (tmp_path / "eval" / "eval_report.json").write_text(json.dumps(report))
    assert f"- {report['divergence'][0]}" in write_report(tmp_path).read_text()
    assert f"not identical to greedy: {report['divergence'][0]}" in summary(tmp_path)


@pytest.mark.integration
def test_report_never_meets_clp_with_an_uncalibrated_predictor_beside_it(tmp_path):
    from mtp_train.report import summary, write_report

    report = _flagged_run(tmp_path)
    # an uncalibrated predictor.json next to the report: "not calibrated (accepts nothing)", never met
    (tmp_path / "clp" / "clp").mkdir(parents=True)
    (tmp_path / "clp" / "clp" / "predictor.json").write_text(json.dumps({"threshold": 1.0, "calibrated": False}))
    report["predictors"] = {}
    report["flags"], report["modes"]["clp"] = [], _mode(1.5, 1.3) | {"tokens_per_s": 1.0, "acceptance": [0.2],
                                                                      "greedy_match_rate": 0.5}
    report["details"]["clp"]["plausible_max_speedup"] = 1.5
    (tmp_path / "eval" / "eval_report.json").write_text(json.dumps(report))
    assert "not calibrated (accepts nothing) | **no** |" in write_report(tmp_path).read_text()
    assert "target NOT met: clp: speedup within its quality bounds" in summary(tmp_path)


def test_report_tree_targets_and_the_shortfall_explanation():
    from mtp_train.report import TARGETS, shortfall_lines, target_rows

    def mode(speed, tau):
        return {"speedup_vs_hf": speed, "tau": tau, "identical_to_greedy": True, "speedup_vs_best_hf": speed}

    report = {"modes": {"verify": mode(1.1, 1.4), "tree": mode(1.2, 1.6)},
              "decoder": {"trees": {"candidates": [
                  {"label": "tree4", "nodes": 4, "predicted_tau": 1.6, "verify_cost": 1.0, "draft_cost": 0.1},
                  {"label": "tree63", "nodes": 63, "predicted_tau": 2.3, "verify_cost": 3.0, "draft_cost": 0.4}]}}}
    rows = {what: met for what, _, _, met in target_rows(report, None)}
    assert rows["tree: tau"] is False and rows["tree: speedup vs HF generate (same dtype), identical output"] is False
    report["modes"]["tree"] = mode(TARGETS["tree_speedup"], TARGETS["tree_tau"])
    rows = {what: met for what, _, _, met in target_rows(report, None)}
    assert rows["tree: tau"] is True and rows["tree: speedup vs HF generate (same dtype), identical output"] is True
    heads = {"k": 2, "metrics": {"val/agree_d1": 0.3, "val/agree_d2": 0.2, "val/sim_tau": 1.36}}
    why = shortfall_lines(report, heads)
    assert "0.30 / 0.20" in why[0] and "1.36" in why[0]
    assert "tree63" in why[1] and "2.30" in why[1] and "3.00x" in why[1]
    # the best tau / cost: tree4's 1.6 / 1.1 = 1.45 beats tree63's 2.3 / 3.4
    assert "1.45 (tree4" in why[2]


@pytest.mark.bad_input
def test_mtp_report_names_a_file_a_damaged_record_and_a_read_only_directory_in_one_line(tmp_path, capsys):
    """mtp-report on a file, on heads.json without its keys, on a damaged eval_report.json, and on a
    directory it cannot write: exit 2 and one line each, never a traceback."""
    import json
    import os

    from mtp_train.cli.report import main

    a_file = tmp_path / "afile"
    a_file.write_text("x")
    (tmp_path / "r1" / "train").mkdir(parents=True)
    (tmp_path / "r1" / "train" / "heads.json").write_text(json.dumps({"heads": {}}))
    (tmp_path / "r2" / "eval").mkdir(parents=True)
    (tmp_path / "r2" / "eval" / "eval_report.json").write_text('{"modes": ')
    (tmp_path / "r3" / "eval").mkdir(parents=True)
    (tmp_path / "r3" / "eval" / "eval_report.json").write_text("[]")  # not "no evaluation yet"
    for root, message in ((a_file, "afile: not a directory; mtp-report reads a pipeline run's directory"),
                          (tmp_path / "r1", "r1: a record there lacks what the report reads (KeyError: 'backbone')"),
                          (tmp_path / "r2", "eval_report.json: not a readable JSON record"),
                          (tmp_path / "r3", "eval_report.json: holds a list, not an object as its stage writes")):
        assert main([str(root)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    readable = {"modes": {"greedy": {"n_prompts": 1, "tokens_per_s": 9.0, "tau": 1.0, "greedy_match_rate": 1.0,
                                     "repetition_ratio": 0.0, "backbone_nll": 1.0, "speedup_vs_hf": 1.0}}}
    (tmp_path / "r1" / "train" / "heads.json").unlink()
    (tmp_path / "r1" / "eval").mkdir()
    (tmp_path / "r1" / "eval" / "eval_report.json").write_text(json.dumps(readable))
    if os.geteuid() == 0:  # root writes anywhere: make the report's own file a directory instead
        (tmp_path / "r1" / "report.md").mkdir()
    else:
        os.chmod(tmp_path / "r1", 0o555)
    assert main([str(tmp_path / "r1")]) == 2
    assert "r1/report.md: cannot write the report" in capsys.readouterr().err
    assert not list((tmp_path / "r1").glob("report.md.tmp*"))  # no temporary left behind


@pytest.mark.bad_input
def test_an_evaluation_of_other_heads_is_not_reported_beside_these(tmp_path):
    """Retrained heads (k=2) beside an evaluation of the earlier ones (k=3, tau 3.88, impossible for
    k=2) made one page of both (hostile round 5): refused naming both files."""
    from mtp_train.report import check_same_heads

    train, ev = tmp_path / "train", tmp_path / "eval"
    heads = {"k": 2, "weights_sha256": "a" * 64}
    for report, stale in (({"k": 3, "heads_sha256": "b" * 64}, True), ({"k": 2, "heads_sha256": "b" * 64}, True),
                          ({"k": 3}, True), ({"k": 2, "heads_sha256": "a" * 64}, False), ({"k": 2}, False)):
        if stale:
            with pytest.raises(MtpError, match=r"eval_report\.json was measured on other heads than .*heads\.safetensors"):
                check_same_heads(heads, report, train, ev)
        else:
            check_same_heads(heads, report, train, ev)


@pytest.mark.bad_input
def test_a_directory_where_a_json_record_belongs_is_named(tmp_path):
    """heads.json or eval_report.json replaced by a directory ended in IsADirectoryError tracebacks
    (hostile round 5)."""
    from mtp_train.artifacts import read_json

    (tmp_path / "heads.json").mkdir()
    with pytest.raises(MtpError, match=r"heads\.json: cannot be read as a JSON record \(IsADirectoryError\)"):
        read_json(tmp_path / "heads.json")
    assert read_json(tmp_path / "absent.json") is None


def test_a_plot_at_a_symlink_replaces_the_link_and_leaves_its_target_alone(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mtp_train.artifacts import save_figure

    precious = tmp_path / "precious.txt"
    precious.write_text("the user's")
    out = tmp_path / "out"
    out.mkdir()
    (out / "speedup.png").symlink_to(precious)
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    save_figure(fig, out / "speedup.png")
    plt.close(fig)
    assert precious.read_text() == "the user's"
    assert not (out / "speedup.png").is_symlink() and (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == ["speedup.png"]  # no temporary left


@pytest.mark.bad_input
def test_the_report_checks_a_predictor_as_mtp_eval_does_before_calling_it_calibrated(tmp_path):
    """A clp/ predictor fitted on other heads, or whose weights were deleted or swapped, was listed as
    "calibrated: yes" (hostile round 3, B5 and P16): the page says why it is not, and the clp target
    row reads it as accepting nothing."""
    import torch
    from safetensors.torch import save_file

    from mtp_train.artifacts import file_sha256
    from mtp_train.clp import calibration_seal
    from mtp_train.report import write_report

    report = _flagged_run(tmp_path)
    report.update(heads_sha256="a" * 64, predictors={}, flags=[])
    report["modes"]["clp"] = _mode(1.5, 1.3) | {"tokens_per_s": 1.0, "acceptance": [0.2], "greedy_match_rate": 0.5}
    report["details"]["clp"]["plausible_max_speedup"] = 1.6
    (tmp_path / "eval" / "eval_report.json").write_text(json.dumps(report))
    pred = tmp_path / "clp" / "clp"
    pred.mkdir(parents=True)
    save_file({"w": torch.ones(3)}, str(pred / "predictor.safetensors"))
    meta = {"kind": "clp", "threshold": 0.5, "calibrated": True, "parameters": 3, "heads_sha256": "a" * 64,
            "weights_sha256": file_sha256(pred / "predictor.safetensors")}
    meta["seal"] = calibration_seal(meta)  # as mtp-clp writes it: covers `calibrated`, which the page overrides

    def page_with(**change) -> str:
        (pred / "predictor.json").write_text(json.dumps({**meta, **change}))
        return write_report(tmp_path).read_text()

    page = page_with()
    assert "| clp | 3 | 0.50 | yes |" in page and "not calibrated (accepts nothing)" not in page
    page = page_with(heads_sha256="b" * 64)
    assert "| clp | 3 | 0.50 | no: fitted on other heads' acceptance: rerun mtp-clp for these heads |" in page
    assert "not calibrated (accepts nothing) | **no** |" in page
    save_file({"w": torch.zeros(3)}, str(pred / "predictor.safetensors"))  # other weights put in its place
    page = page_with()
    assert "no: predictor.safetensors is not the one mtp-clp fitted" in page
    (pred / "predictor.safetensors").unlink()
    assert "no: predictor.safetensors is missing" in page_with()
    # hostile round 4: other heads AND a broken seal read "threshold changed"; the first reason is the one
    page = page_with(heads_sha256="b" * 64, threshold=0.9)
    assert "| clp | 3 | - | no: fitted on other heads' acceptance" in page
    save_file({"w": torch.ones(3)}, str(pred / "predictor.safetensors"))  # the fitted weights back
    assert "| clp | 3 | 0.50 | yes |" in page_with()
    # a swapped kind, and a calibrated predictor without a threshold, were "calibrated: yes"
    assert "no: predictor.json in clp/ says kind 'gate' where a clp predictor belongs" in page_with(kind="gate")
    page = page_with(threshold=None, seal=calibration_seal({**meta, "threshold": None}))
    assert "| clp | 3 | - | no: marked calibrated but holds no threshold" in page
    assert "not calibrated (accepts nothing) | **no** |" in page
    # an edited threshold: the page says so on its row instead of failing the report
    assert "no: the threshold or its calibration record was changed" in page_with(threshold=0.7)
    # why a predictor accepts nothing: the threshold its calibration stopped at, with the figures that
    # failed it; or why it was never calibrated (run M's gate read "no threshold met the bounds")
    row = {"threshold": 0.95, "tau": 1.07, "nll_increase": 0.249, "nll_increase_upper": 0.372,
           "repetition_increase": -0.004, "repetition_increase_upper": 0.0, "stopped_after": [0.9, 0.8]}
    failed = {"threshold": 1.0, "calibrated": False, "bounds": {"bound_z": 1.0},
              "calibration": {"greedy": {}, "thresholds": [{**row, "threshold": 0.8, "tau": 1.3}, row], "n_prompts": 6}}
    # (every threshold decoded, in the configured order: the most cautious failure is the one shown)
    page = page_with(**failed, seal=calibration_seal({**meta, **failed}))
    assert ("| clp | 3 | 1.00 | no threshold met the bounds, accepts nothing extra (at 0.95: tau 1.07, NLL +0.249 "
            "(+0.372 with 1 SE), repetition -0.004 (+0.000) over greedy on 6 prompts) |") in page
    passed = {**failed, "threshold": 0.95, "calibrated": True}
    page = page_with(**passed, seal=calibration_seal({**meta, **passed}))
    assert "| clp | 3 | 0.95 | yes (at 0.95: tau 1.07, NLL +0.249" in page
    skipped = {"threshold": 1.0, "calibrated": False, "not_calibrated": "eval.modes ['tree'] decodes no mode of it"}
    page = page_with(**skipped, seal=calibration_seal({**meta, **skipped}))
    assert "| clp | 3 | 1.00 | not calibrated (eval.modes ['tree'] decodes no mode of it): accepts nothing extra |" in page
    # a record from before the per-prompt test: the verdict alone
    old = {**failed, "calibration": {"thresholds": [{"threshold": 0.95, "tau": 1.07}], "n_prompts": 3}}
    page = page_with(**old, seal=calibration_seal({**meta, **old}))
    assert "| clp | 3 | 1.00 | no threshold met the bounds, accepts nothing extra |" in page
    # a predictor directory without its predictor.json was left off the page
    (pred / "predictor.json").unlink()
    assert "| clp | - | - | no: predictor.json is missing" in write_report(tmp_path).read_text()


def test_a_predictor_for_another_k_or_hidden_size_is_not_calibrated_for_these_heads(tmp_path):
    """hostile round 4: a predictor.json fitted for k=5 beside k=3 heads read "calibrated: yes"; mtp-eval
    refuses it (clp.load_predictor), and so does the report."""
    import torch
    from safetensors.torch import save_file

    from mtp_train.artifacts import file_sha256
    from mtp_train.report import predictor_problem

    pred = tmp_path / "clp"
    pred.mkdir()
    save_file({"w": torch.ones(3)}, str(pred / "predictor.safetensors"))
    meta = {"kind": "clp", "k": 3, "hidden_size": 8, "weights_sha256": file_sha256(pred / "predictor.safetensors")}
    heads = {"k": 3, "backbone": {"hidden_size": 8}}
    assert predictor_problem(meta, pred, heads, None) is None
    assert "fitted for k=5, these heads and backbone have k=3" in predictor_problem({**meta, "k": 5}, pred, heads, None)
    assert "hidden_size=16" in predictor_problem({**meta, "hidden_size": 16}, pred, heads, None)
    assert predictor_problem({**meta, "k": 5}, pred, None, None) is None  # no heads.json: nothing to hold it to


@pytest.mark.bad_input
@pytest.mark.parametrize("field,value,why", [("tau", 99.0, r"outside \[1, k \+ 1 = 2\]"), ("tau", 0.5, "outside"),
                                             ("speedup_vs_hf", float("nan"), "not a finite number"),
                                             ("speedup_vs_hf", -1.0, "not a positive number"),
                                             ("acceptance", [0.5, 1.5], r"\[1\] is 1.5, not a rate"),
                                             ("greedy_match_rate", 2, "not a rate")])
def test_an_eval_report_with_impossible_figures_is_refused_naming_the_figure(tmp_path, field, value, why):
    """hostile round 4: tau 99 or NaN in eval_report.json was put on the page as a result."""
    from mtp_train.errors import MtpError
    from mtp_train.report import summary, write_report

    report = _flagged_run(tmp_path)
    report["modes"]["verify"][field] = value
    (tmp_path / "eval" / "eval_report.json").write_text(json.dumps(report))
    with pytest.raises(MtpError, match=rf"eval/eval_report.json: modes.verify.{field}.*{why}.*rerun mtp-eval"):
        write_report(tmp_path)
    with pytest.raises(MtpError, match=rf"modes.verify.{field}"):
        summary(tmp_path)
