"""mtp-eval: metrics against hand computations, the report's contract, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mtp_train.cli.eval import run_eval
from mtp_train.errors import MtpError
from mtp_train.evaluate import backbone_nll, first_divergence, repetition_ratio

CORE_KEYS = {"tau", "alpha", "tokens_per_s", "speedup_vs_hf", "repetition_ratio", "backbone_nll",
             "greedy_match_rate", "identical_to_greedy", "n_prompts", "new_tokens"}
FAST = ["backbone=tiny", "logger=none", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "data.distill.max_train_prompts=16", "data.distill.max_val_prompts=4"]


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


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.cli.train import run_train
    from mtp_train.config import validate

    root = tmp_path_factory.mktemp("eval")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(compose("config", overrides=[f"paths.root_dir={root}", f"paths.output_dir={root}/train",
                                                    *FAST, "heads.k=2"]))
    run_train(cfg)
    return root


def _eval_cfg(root, *overrides):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config import validate

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return validate(compose("config", overrides=[
            f"paths.root_dir={root}", f"paths.output_dir={root}/eval", *FAST, "eval.n_prompts=3",
            "eval.max_new_tokens=12", f"eval.heads={root}/train", *overrides]))


def test_eval_report_has_the_contracted_keys_and_verify_is_lossless(trained_heads):
    root = trained_heads
    report = run_eval(_eval_cfg(root, "eval.modes=[greedy,verify,relaxed,adaptive]", "eval.budget=0"))
    saved = json.loads((root / "eval" / "eval_report.json").read_text())
    assert set(saved["modes"]) == {"hf_generate", "greedy", "verify", "relaxed", "adaptive"}
    for name, m in saved["modes"].items():
        assert set(m) == CORE_KEYS, name
        assert m["n_prompts"] == 3 and 3 <= m["new_tokens"] <= 36
    v = saved["modes"]["verify"]
    assert v["identical_to_greedy"] is True and v["greedy_match_rate"] == 1.0
    assert saved["modes"]["relaxed"]["identical_to_greedy"] is True  # budget 0 = verify
    assert 1.0 <= v["tau"] <= 3.0 and len(v["alpha"]) == 2
    assert saved["modes"]["greedy"]["backbone_nll"] == pytest.approx(v["backbone_nll"])
    assert saved["step_cost"] > 0 and saved["k"] == 2 and saved["sim_tau"] is not None
    hist = saved["details"]["verify"]["accept_hist"]
    assert len(hist) == 3 and sum(hist) > 0
    assert math.isclose(saved["modes"]["hf_generate"]["speedup_vs_hf"], 1.0)
    assert (root / "eval" / "speedup.png").stat().st_size > 0 and (root / "eval" / "acceptance.png").is_file()
    assert report["modes"]["verify"] == v


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
    with pytest.raises(MtpError, match="eval.heads"):
        run_eval(_eval_cfg(root, "eval.heads=null"))
    bad = tmp_path / "heads"
    bad.mkdir()
    (bad / "heads.json").write_text((root / "train" / "heads.json").read_text())
    (bad / "heads.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(MtpError, match="heads.safetensors: not a readable safetensors"):
        run_eval(_eval_cfg(root, f"eval.heads={bad}"))


def test_over_long_prompts_are_skipped_and_counted(trained_heads, tmp_path):
    root = trained_heads
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "short one"}\n{"prompt": "' + "long " * 200 + '"}\n')
    report = run_eval(_eval_cfg(root, f"eval.prompts={f}", "eval.max_prompt_tokens=200", "eval.modes=[greedy]"))
    assert report["skipped_prompts"] == 1 and report["modes"]["greedy"]["n_prompts"] == 1


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


def test_mtp_clp_then_eval_with_clp_gate_and_clp_verify(trained_heads, monkeypatch):
    import shutil

    from mtp_train.cli.clp import run_clp

    root = trained_heads
    clp_args = ["clp.label_source=decode", "clp.n_prompts=6", "clp.shard_prompts=3", "clp.max_new_tokens=16", "clp.epochs=3",
                "clp.calib_prompts=2", "clp.taus=[0.9,0.5]", "eval.max_new_tokens=12",
                f"clp.heads={root}/train"]
    cfg = _eval_cfg(root, *clp_args, f"paths.output_dir={root}/clp")
    res = run_clp(cfg)
    assert sum(res["label"]["label_histogram"]) == res["label"]["rows"] > 0
    assert set(res["fit"]) == {"clp", "gate"} and set(res["calibrate"]) == {"clp", "gate"}
    meta = json.loads((root / "clp" / "clp" / "clp.json").read_text())
    assert meta["parameters"] == 64 * 3 + 3 and meta["tau"] in (0.9, 0.5, 1.0) and "calibration" in meta
    # a rerun skips every finished stage (and keeps their wall times); other taus recalibrate only
    times = json.loads((root / "clp" / "stage_times.json").read_text())
    again = run_clp(cfg)
    assert again["label"] == res["label"]
    assert all(r["skipped"] for stage in ("fit", "calibrate") for r in again[stage].values())
    assert json.loads((root / "clp" / "stage_times.json").read_text()) == times
    retuned = run_clp(_eval_cfg(root, *clp_args[:-1], "clp.taus=[0.9,0.6]", f"clp.heads={root}/train",
                                f"paths.output_dir={root}/clp"))
    assert all(r["skipped"] for r in retuned["fit"].values())
    assert not any(r["skipped"] for r in retuned["calibrate"].values())
    eval_args = ["eval.modes=[greedy,clp,gate,clp+verify]", f"eval.clp={root}/clp/clp", f"eval.gate={root}/clp/gate"]
    report = run_eval(_eval_cfg(root, *eval_args))
    import mtp_train.evaluate as evaluate_mod

    def no_decoding(*a, **k):
        raise AssertionError("a finished evaluation decoded again")

    with monkeypatch.context() as m:
        m.setattr(evaluate_mod, "run_modes", no_decoding)
        assert run_eval(_eval_cfg(root, *eval_args)) == report  # same inputs: the saved report
        with pytest.raises(AssertionError, match="decoded again"):  # another setting measures again
            run_eval(_eval_cfg(root, *eval_args, "eval.delta=0.2"))
    assert report["modes"]["clp+verify"]["identical_to_greedy"] is True
    assert set(report["modes"]["clp"]) == CORE_KEYS
    _check_pipeline_report(root, report)
    assert report["predictors"]["gate"]["parameters"] > 100 * report["predictors"]["clp"]["parameters"]
    # eval.span_tau maps the trade-off at a tau of one's choosing; clp+verify stays lossless
    report = run_eval(_eval_cfg(root, "eval.modes=[greedy,clp,clp+verify]", f"eval.clp={root}/clp/clp",
                                "eval.span_tau=0.05"))
    assert report["predictors"]["clp"]["tau"] == 0.05 == report["predictors"]["clp+verify"]["tau"]
    assert report["modes"]["clp+verify"]["identical_to_greedy"] is True
    # labels made with other heads are refused by the fit stage
    other = root / "other"
    shutil.copytree(root / "train", other)
    from safetensors.torch import load_file, save_file

    state = load_file(str(other / "heads.safetensors"))
    save_file({n: t + 1e-3 for n, t in state.items()}, str(other / "heads.safetensors"))
    with pytest.raises(MtpError, match="another heads checkpoint"):
        run_clp(_eval_cfg(root, *clp_args[:-1], f"clp.heads={other}", f"paths.output_dir={root}/clp",
                          "stage=fit"))


def _check_pipeline_report(root, report):
    """mtp-report over train/, clp/ and eval/ of the run above: every section with its figures."""
    from mtp_train.report import write_report

    page = write_report(root).read_text()
    assert "heads: chained, k = 2" in page
    verify_free = report["modes"]["clp"]
    assert f"| clp | {verify_free['speedup_vs_hf']:.2f}x |" in page
    assert "| clp | 195 |" in page.replace(",", "")  # the predictor table: 64 * 3 + 3 parameters
    assert "## Sample outputs" in page and "*clp*:" in page
    assert "| train |" in page and "| clp |" in page


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
    with pytest.raises(MtpError, match="nothing to report"):
        write_report(tmp_path / "empty")


def test_labels_from_the_cache_are_the_labels_decoding_gives_on_the_same_greedy_text(trained_heads, tmp_path):
    """The cache route (teacher-forced drafts on the backbone's own greedy text) gives, at every
    step of a verify decode, the label m* that the decode itself records."""
    import numpy as np
    from datasets import load_from_disk

    from mtp_train.backbone import load_backbone
    from mtp_train.cli.prep import labelled_dir
    from mtp_train.data.labels import labels_from_cache
    from mtp_train.decoding import Decoder
    from mtp_train.evaluate import held_out_prompts
    from mtp_train.heads import load_heads
    from mtp_train.targets import IGNORE

    root = trained_heads
    cfg = _eval_cfg(root)
    backbone = load_backbone(cfg.backbone)
    heads, _ = load_heads(root / "train", backbone)
    torch.manual_seed(0)
    with torch.no_grad():  # trained heads are always right on the tiny language: make them err
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * p.std() * 1.5)
    dec = Decoder(backbone, heads, eos_ids=[])
    rows, hidden, top, decoded = [], [], [], {}
    for i, prompt in enumerate(held_out_prompts(labelled_dir(cfg), "train")[:4]):
        res = dec.generate(prompt, 24, "verify", trace=True)
        ids = torch.tensor(prompt + res.tokens)
        with torch.no_grad():
            h = backbone.hidden_states(ids[None])[0]
            top.append(backbone.logits(h).argmax(-1).numpy())
        hidden.append(h.numpy())
        rows.append({"input_ids": ids.tolist(), "labels": [IGNORE] * len(prompt) + res.tokens})
        decoded.update({(i, p): kept for p, drafts, kept in res.trace
                        if len(drafts) == heads.k and p + heads.k + 1 < len(ids)})

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
    assert "NOT identical" in rows[0][2] and "+0.050" in rows[2][2]
    assert target_rows(bad, None, {"max_repetition_increase": 0.06})[2][3] is True  # the run's own bounds
