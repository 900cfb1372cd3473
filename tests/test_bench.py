"""bench/scaling.py and bench/recipes.py on the tiny backbone: every point trained, measured, reported."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.integration
def test_scaling_curve_points_fit_and_plot(tmp_path, monkeypatch):
    import scaling

    monkeypatch.chdir(tmp_path)
    args = ["--out", str(tmp_path / "curve"), "--fractions", "0.5,1", "--prompts", "1",
            f"paths.root_dir={tmp_path}", "backbone=tiny", "logger=none", "trainer.max_steps=3",
            "trainer.val_check_interval=3", "trainer.enable_progress_bar=false", "heads.k=2",
            "eval.max_new_tokens=8", "data.distill.max_train_prompts=16", "data.distill.max_val_prompts=4"]
    assert scaling.main(args) == 0
    out = json.loads((tmp_path / "curve" / "scaling.json").read_text())
    points = out["points"]
    assert [(p["source"], p["fraction"]) for p in points] == [
        ("labelled", 0.5), ("labelled", 1.0), ("distilled", 0.5), ("distilled", 1.0)]
    for a, b in (points[:2], points[2:]):
        assert 0 < a["train_tokens"] < b["train_tokens"] and a["train_rows"] < b["train_rows"]
    assert all(p["steps"] == 3 and p["identical_to_greedy"] and p["tau"] >= 1.0 for p in points)
    assert set(out["fits"]) == {"labelled", "distilled"}
    assert (tmp_path / "curve" / "scaling.png").stat().st_size > 0
    assert "| distilled | 1 |" in (tmp_path / "curve" / "scaling.md").read_text()


@pytest.mark.parametrize("taus,slope", [([1.2, 1.4], True), ([1.3, 1.3], False)])
def test_log_fit_recovers_a_known_line(taus, slope):
    import math

    import scaling

    pts = [{"train_tokens": 1000, "tau": taus[0]}, {"train_tokens": 4000, "tau": taus[1]}]
    fit = scaling.log_fit(pts)
    assert fit["b"] == pytest.approx((taus[1] - taus[0]) / math.log(4))
    if slope:  # tau = 1.2 + 0.2 * log4(tokens / 1000): 1.9 at 1000 * 4 ** 3.5
        assert fit["tokens_for_target"] == pytest.approx(1000 * 4 ** 3.5, rel=1e-6)
    else:
        assert fit["tokens_for_target"] is None


def _tiny_recipes(tmp_path) -> list[str]:
    """bench/recipes.py's Hydra overrides for the tiny backbone."""
    return [f"paths.root_dir={tmp_path}", "backbone=tiny", "logger=none", "heads.k=2",
            "trainer.enable_progress_bar=false", "data.distill.max_train_prompts=16",
            "data.distill.max_val_prompts=4"]


@pytest.mark.integration
def test_recipe_comparison_trains_each_recipe_and_ranks_them(tmp_path, monkeypatch):
    import recipes

    monkeypatch.chdir(tmp_path)
    args = ["--out", str(tmp_path / "rec"), "--steps", "2", "--only", "kl_random,medusa_kl_lr3e-3",
            *_tiny_recipes(tmp_path)]
    assert recipes.main(args) == 0
    rows = json.loads((tmp_path / "rec" / "recipes.json").read_text())
    assert {r["recipe"] for r in rows} == {"kl_random", "medusa_kl_lr3e-3"}
    assert rows[0]["sim_tau"] >= rows[1]["sim_tau"] and all(r["steps"] == 2 for r in rows)
    assert all(len(r["acc"]) == len(r["alpha"]) == 2 and None not in r["acc"] + r["alpha"] for r in rows)
    assert all(1.0 <= r["sim_tau_t1.0"] <= 3.0 for r in rows)  # speculative sampling's, beside greedy's
    assert json.loads((tmp_path / "rec" / "medusa_kl_lr3e-3" / "heads.json").read_text())["head_type"] == "medusa"
    with pytest.raises(SystemExit):
        recipes.main(["--only", "nonsense"])


@pytest.mark.integration
def test_recipe_comparison_at_equal_cpu_minutes_gives_each_recipe_the_same_budget(tmp_path, monkeypatch):
    import recipes

    monkeypatch.chdir(tmp_path)
    args = ["--out", str(tmp_path / "rec"), "--minutes", "0.05", "--steps", "300", "--only", "demo,noise0.1",
            *_tiny_recipes(tmp_path)]
    assert recipes.main(args) == 0
    rows = json.loads((tmp_path / "rec" / "recipes.json").read_text())
    assert {r["recipe"] for r in rows} == {"demo", "noise0.1"}
    for r in rows:
        b = json.loads((tmp_path / "rec" / r["recipe"] / "heads.json").read_text())["recipe"]["budget"]
        assert b["budget_s"] == pytest.approx(3.0) and 10 <= r["steps"] == b["steps"] <= 300
    assert "0.05 CPU minutes each" in (tmp_path / "rec" / "recipes.md").read_text()


@pytest.mark.integration
def test_long_run_trains_points_with_steps_in_proportion_and_reports_the_targets(tmp_path, monkeypatch):
    import long_run

    monkeypatch.chdir(tmp_path)
    args = ["--out", str(tmp_path / "long"), "--fractions", "0.5,1", "--prompts", "2", "--prompt-source",
            "validation", f"paths.root_dir={tmp_path}", "experiment=smollm2_demo", "backbone=tiny",
            "logger=none", "trainer.max_steps=4", "trainer.enable_progress_bar=false", "heads.k=2",
            "eval.max_new_tokens=8", "data.distill.max_train_prompts=16", "data.distill.max_val_prompts=4",
            "clp.calib_prompts=1", "clp.thresholds=[0.5]", "clp.epochs=2"]
    assert long_run.main(args) == 0
    out = json.loads((tmp_path / "long" / "long_run.json").read_text())
    points = out["points"]
    assert [(p["fraction"], p["steps"]) for p in points] == [(0.5, 2), (1.0, 4)]  # steps follow the data
    assert points[0]["train_tokens"] < points[1]["train_tokens"]
    for p in points:
        assert p["identical"] and p["chain_tau"] >= 1.0 and p["tree_tau"] >= 1.0 and len(p["agree"]) == 2
        assert isinstance(p["clp_calibrated"], bool) and p["clp_speedup"] > 0
    md = (tmp_path / "long" / "long_run.md").read_text()
    assert "targets at the last point" in md and "depth-1 agreement" in md
    assert (tmp_path / "long" / "long_run.png").stat().st_size > 0


@pytest.mark.integration
def test_gpu_check_script_composes_every_config_it_runs(tmp_path):
    """CPU side of bench/gpu_check.sh: each Hydra command it would run on a GPU composes (a typo in a
    trainer or key name fails here, not on the borrowed GPU)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    bindir = Path(sys.executable).parent
    env = {**os.environ, "OUT": str(tmp_path / "gpu"), "BIN": str(bindir)}
    r = subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), "--compose-only"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("prep", "cache", "train_gpu", "train_deepspeed2", "eval"):
        assert f"COMPOSED {name}" in r.stdout
    ds = (tmp_path / "gpu" / "train_deepspeed2.compose.yaml").read_text()
    assert "DeepSpeedStrategy" in ds and "bf16-mixed" in ds
    assert "accelerator: gpu" in (tmp_path / "gpu" / "train_gpu.compose.yaml").read_text()


@pytest.mark.integration
def test_length_batches_bench_times_both_orders_and_grouping_pads_less(tmp_path, monkeypatch, capsys):
    import length_batches

    monkeypatch.chdir(tmp_path)
    args = ["--steps", "2", "--rounds", "2", f"paths.root_dir={tmp_path}", "backbone=tiny", "heads.k=2",
            "train.length_window=4", "data.distill.max_train_prompts=16", "data.distill.max_val_prompts=4"]
    assert length_batches.main(args) == 0
    out = capsys.readouterr().out
    pads = {line.split()[0]: float(line.split("(epoch)")[1].split()[0])
            for line in out.splitlines() if "padded slots" in line}
    assert set(pads) == {"random", "length_window=4"} and pads["length_window=4"] < pads["random"]
    assert "CPU:" in out and "step time ratio (random / grouped)" in out


def test_padded_slots_counts_each_batch_at_its_longest_row():
    from length_batches import padded_slots

    lengths = [5, 1, 3, 3, 2]
    # batches [0, 1], [2, 3], [4] -> 2 * 5 + 2 * 3 + 1 * 2 slots for 14 real tokens
    assert padded_slots(lengths, [0, 1, 2, 3, 4], 2) == (18, 14)
    assert padded_slots(lengths, [0, 2, 3, 4, 1], 2) == (17, 14)


@pytest.mark.integration
def test_lora_bench_trains_frozen_and_lora_points_and_reports_the_drift(tmp_path, monkeypatch):
    import lora

    monkeypatch.chdir(tmp_path)
    args = ["--out", str(tmp_path / "lora"), "--points", "frozen,lora_adamtp",
            f"paths.root_dir={tmp_path}", "backbone=tiny", "logger=none", "trainer.max_steps=3",
            "trainer.val_check_interval=3", "trainer.enable_progress_bar=false", "heads.k=2", "train.lr=2e-2",
            "eval.max_new_tokens=8", "eval.n_prompts=2", "data.distill.max_train_prompts=16",
            "data.distill.max_val_prompts=4", "data.max_conversations=64"]
    assert lora.main(args) == 0
    rows = json.loads((tmp_path / "lora" / "lora.json").read_text())["rows"]
    assert set(rows) == {"frozen", "lora_adamtp"}
    assert rows["frozen"]["drift"] is None and rows["frozen"]["loss_distill"] is None
    d = rows["lora_adamtp"]["drift"]
    assert d["n_prompts"] == 2 and 0 <= d["prefix_match"] <= 1 and rows["lora_adamtp"]["loss_distill"] > 0
    assert all(m is not None for m in rows["lora_adamtp"]["masked"])
    assert all(r["verify_identical_to_greedy"] and r["tree_identical_to_greedy"] for r in rows.values())
    text = (tmp_path / "lora" / "lora.md").read_text()
    assert "| frozen |" in text and "| lora_adamtp |" in text and "CPU:" in text


def _serve_check_json(**over) -> dict:
    r = {"engine_tau": 1.42, "ours_tau": 1.41, "engine_accept_per_pos": [0.3, 0.1, 0.02],
         "engine_tok_s_with_drafter": 15.0, "engine_tok_s_without": 12.0, "identical": True, "agree": True,
         "prompt_source": "unseen", "n_prompts": 20, "n_prompts_asked": 20, "max_new_tokens": 48, "rounds": 1,
         "tampered": None, "heads_sha256": "aaa"}
    return {**r, **over}


def test_peer_bench_engine_columns_read_the_engines_own_counters_and_speed():
    from peer_side_by_side import engine_columns

    cols = engine_columns(_serve_check_json())
    assert cols["engine_tau"] == 1.42 and cols["ours_chain_tau"] == 1.41
    assert cols["engine_accept"] == [0.3, 0.1, 0.02]
    assert cols["engine_speedup"] == pytest.approx(15.0 / 12.0)
    assert cols["engine_lossless"] is True and cols["engine_agree"] is True
    cols = engine_columns(_serve_check_json(identical=False, agree=False, engine_tok_s_without=0.0))
    assert cols["engine_lossless"] is False and cols["engine_agree"] is False and cols["engine_speedup"] is None


def test_peer_bench_reuses_an_engine_check_only_with_the_same_prompts_and_rounds(tmp_path, monkeypatch):
    import peer_side_by_side

    from mtp_train import layout
    from mtp_train.engine import check

    calls = []
    monkeypatch.setattr(check, "serve_check", lambda run, **kw: calls.append(kw) or _serve_check_json(fresh=True))
    meta = tmp_path / layout.HEADS_META
    meta.write_text(json.dumps({"weights_sha256": "aaa"}))
    (tmp_path / check.SERVE_CHECK_DIR).mkdir()
    done = tmp_path / check.SERVE_CHECK_DIR / "serve_check.json"
    done.write_text(json.dumps(_serve_check_json()))
    assert "fresh" not in peer_side_by_side.engine_result(tmp_path, 20, 48, 1) and not calls
    meta.write_text(json.dumps({"weights_sha256": "bbb"}))  # heads trained again after the check: checked again
    assert peer_side_by_side.engine_result(tmp_path, 20, 48, 1)["fresh"]
    calls.clear()
    meta.write_text(json.dumps({"weights_sha256": "aaa"}))
    for args in ((40, 48, 1), (20, 32, 1), (20, 48, 3)):  # another count, length or rounds: checked again
        assert peer_side_by_side.engine_result(tmp_path, *args)["fresh"]
    assert [(c["n_prompts"], c["max_new_tokens"], c["rounds"]) for c in calls] == [(40, 48, 1), (20, 32, 1), (20, 48, 3)]
    assert all(c["prompt_source"] == "unseen" for c in calls)
    # the source held fewer unseen prompts than asked: the check records both, and is reused for the same ask
    done.write_text(json.dumps(_serve_check_json(n_prompts=17, n_prompts_asked=20)))
    calls.clear()
    assert "fresh" not in peer_side_by_side.engine_result(tmp_path, 20, 48, 1) and not calls
    assert peer_side_by_side.engine_result(tmp_path, 17, 48, 1)["fresh"]
    for stale in (_serve_check_json(tampered="aux_layers"), _serve_check_json(prompt_source="validation")):
        (tmp_path / check.SERVE_CHECK_DIR / "serve_check.json").write_text(json.dumps(stale))
        assert peer_side_by_side.engine_result(tmp_path, 20, 48, 1)["fresh"]


def test_peer_bench_reuses_the_peers_training_only_for_the_same_command(tmp_path, monkeypatch):
    import subprocess

    import peer_side_by_side

    def no_run(*a, **kw):
        raise AssertionError("the peer's trainer must not run again")

    monkeypatch.setattr(subprocess, "run", no_run)
    cmd = ["python", "train.py", "--epochs", "2", "--optimizer", "adamw", "--no-resume-from-checkpoint"]
    save = tmp_path / "peer"
    save.mkdir()
    record = {"wall_s": 12.0, "steps": 240, "train_loop_s": 10, "checkpoint": str(save / "1"), "cmd": cmd}
    (save / "mtp_bench_record.json").write_text(json.dumps(record))
    assert peer_side_by_side.run_peer(list(cmd), save, tmp_path / "peer.log") == record
    with pytest.raises(SystemExit, match=r"--epochs 2 -> 4.*another --out"):
        peer_side_by_side.run_peer([*cmd[:3], "4", *cmd[4:]], save, tmp_path / "peer.log")
    with pytest.raises(SystemExit, match=r"--muon \(none\) -> \(set\)"):
        peer_side_by_side.run_peer([*cmd, "--muon"], save, tmp_path / "peer.log")
    with pytest.raises(SystemExit, match=r"\(program\) python train.py -> python3 train.py"):
        peer_side_by_side.run_peer(["python3", *cmd[1:]], save, tmp_path / "peer.log")
    del record["cmd"]  # a record that does not say what ran is not reused either
    (save / "mtp_bench_record.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="does not say which command"):
        peer_side_by_side.run_peer(list(cmd), save, tmp_path / "peer.log")
    # checkpoints without a record (an interrupted run): not read as this run's
    (save / "mtp_bench_record.json").unlink()
    (save / "4").mkdir()
    (save / "4" / "model.safetensors").write_bytes(b"old")
    with pytest.raises(SystemExit, match=r"checkpoints without a record.*peer/4"):
        peer_side_by_side.run_peer(list(cmd), save, tmp_path / "peer.log")
