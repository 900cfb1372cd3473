"""mtp-serve-check (mtp_train/engine/): the arithmetic that turns the engine's counters and our
decoder's steps into the same figures, the causes a disagreement names, the exports broken on
purpose, and the bad inputs refused in one line. The checks that start the real engine are in
tests/test_engine_serving.py (marker `engine`, `make serve-check`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mtp_train.engine import check, env
from mtp_train.errors import MtpError


def test_counters_over_a_stretch_of_work_are_differences():
    before = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 30,
              "vllm:spec_decode_num_accepted_tokens": 12, "vllm:spec_decode_num_accepted_tokens_per_pos": [7, 4, 1]}
    after = {"vllm:spec_decode_num_drafts": 30, "vllm:spec_decode_num_draft_tokens": 90,
             "vllm:spec_decode_num_accepted_tokens": 40, "vllm:spec_decode_num_accepted_tokens_per_pos": [20, 14, 6]}
    got = check.spec_metrics(before, after)
    assert got == {"drafts": 20, "draft_tokens": 60, "accepted": 28, "accepted_per_pos": [13, 10, 5]}
    # before any speculation the engine may not report the counters at all
    assert check.spec_metrics({}, after)["accepted_per_pos"] == [20, 14, 6]


def test_acceptance_length_and_per_position_match_a_direct_count():
    # 4 drafts of 3 tokens accepting 0, 1, 3 and 2 tokens (accepted tokens always form a prefix)
    accepted = [0, 1, 3, 2]
    per_pos = [sum(a > i for a in accepted) for i in range(3)]
    tau, pos = check.acceptance_from_counts(len(accepted), per_pos)
    assert tau == pytest.approx(sum(a + 1 for a in accepted) / len(accepted))
    assert pos == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert check.acceptance_from_counts(0, [0, 0]) == (1.0, [0.0, 0.0])


def test_our_steps_are_counted_as_the_engine_counts_them():
    # a step that verified no drafts (the last one, at the token budget) is not a draft
    r1 = SimpleNamespace(drafted=[3, 3, 3, 0], accepted=[2, 1, 0], accept_lengths=[2, 3, 1, 1])
    r2 = SimpleNamespace(drafted=[3, 3], accepted=[2, 2, 1], accept_lengths=[4, 3])
    drafts, acc = check.ours_counts([r1, r2], 3)
    assert (drafts, acc) == (5, [4, 3, 1])
    tau, _ = check.acceptance_from_counts(drafts, acc)
    # = committed tokens per drafting step
    assert tau == pytest.approx((2 + 3 + 1 + 4 + 3) / 5)


def test_agreement_within_tolerance_names_no_cause():
    assert check.causes(2.0, 2.0 + 0.9 * check.tau_tolerance(2.0), [0.5, 0.3], [0.508, 0.291],
                        [1, 5, 9], [1, 5, 9], identical=True) == []


def test_the_tolerance_is_a_share_of_what_the_drafter_adds():
    """SmolLM2's demo heads with auxiliary layer ids moved by one: engine 1.265 against ours 1.290,
    -1.9% of tau (inside 5% of tau) but -8.6% of the gain: a disagreement now."""
    assert check.tau_tolerance(1.290) == pytest.approx(0.0145)
    assert check.tau_tolerance(1.02) == check.TAU_FLOOR
    assert check.causes(1.290, 1.265, [0.237, 0.046, 0.006], [0.229, 0.035, 0.001], [2, 15, 27], [3, 16, 28],
                        identical=True)
    assert check.causes(1.290, 1.290, [0.237, 0.046, 0.006], [0.237, 0.046, 0.006], [2, 15, 27], [2, 15, 27],
                        identical=True) == []


@pytest.mark.parametrize("engine_tau,engine_pos,engine_aux,identical,expect", [
    (1.02, [0.02, 0.0], [1, 5, 9], True, "almost none"),
    (1.02, [0.02, 0.0], [2, 6, 10], True, "eagle_aux_hidden_state_layer_ids"),
    (1.70, [0.45, 0.25], [1, 5, 9], True, "fewer drafts"),
    (2.40, [0.70, 0.55], [1, 5, 9], True, "more drafts"),
    (2.0, [0.5, 0.3], [1, 5, 9], False, "not lossless"),
    (2.0, [0.6, 0.2], [1, 5, 9], True, "other positions"),  # the same tau, the positions off by 0.1
])
def test_a_disagreement_names_its_likely_cause(engine_tau, engine_pos, engine_aux, identical, expect):
    why = check.causes(2.0, engine_tau, [0.5, 0.3], engine_pos, [1, 5, 9], engine_aux, identical)
    assert why and expect in " ".join(why)


def test_the_auxiliary_layers_are_read_from_the_engines_log():
    text = "INFO 12-03 [eagle3.py:120] Using auxiliary layers from speculative config: (2, 15, 27)\nmore"
    assert check.engine_aux_layers(text) == [2, 15, 27]
    assert check.engine_aux_layers("no such line") is None


def test_exports_are_broken_on_purpose_as_users_break_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 15, 29],
                                                      "norm_before_residual": False}))
    check.tamper_export(tmp_path, "aux_layers", 30)
    assert json.loads((tmp_path / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 16, 0]
    check.tamper_export(tmp_path, "norm_before_residual", 30)
    assert json.loads((tmp_path / "config.json").read_text())["norm_before_residual"] is True
    with pytest.raises(MtpError, match="not one of"):
        check.tamper_export(tmp_path, "rope", 30)


@pytest.mark.bad_input
def test_a_cpu_without_avx2_is_refused_in_one_line():
    with pytest.raises(MtpError, match="lacks avx2.*cannot run here"):
        env.check_cpu({"sse4_2", "avx"})
    assert "avx2" in env.check_cpu({"avx2", "fma", "avx512f"})


@pytest.mark.bad_input
def test_no_fixed_port_or_python_path_of_ours_reaches_the_engine():
    """The engine's processes bind free loopback ports of their own choosing: a VLLM_PORT or
    MASTER_PORT left in the environment (maybe a port in use) is not passed on, nor our venv's paths."""
    base = {"PATH": "/usr/bin", "VLLM_PORT": "8000", "VLLM_HOST_IP": "10.0.0.1", "MASTER_PORT": "29500",
            "MASTER_ADDR": "node1", "PYTHONPATH": "/work/main", "PYTHONHOME": "/x", "VLLM_CPU_OMP_THREADS_BIND": "all"}
    got = check.engine_environment({"kv_gib": 2}, base)
    assert got["PATH"] == "/usr/bin" and got["VLLM_CPU_OMP_THREADS_BIND"] == "all"
    assert not {"VLLM_PORT", "VLLM_HOST_IP", "MASTER_PORT", "MASTER_ADDR", "PYTHONPATH", "PYTHONHOME"} & set(got)
    assert (got["VLLM_CPU_KVCACHE_SPACE"], got["HF_HUB_OFFLINE"]) == ("2", "1")


@pytest.mark.bad_input
def test_a_missing_engine_environment_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_ROOT", str(tmp_path))
    monkeypatch.setattr(env, "check_cpu", lambda flags=None: {"avx2"})
    (tmp_path / "run").mkdir()
    with pytest.raises(MtpError, match="engine environment is not built .*make engine-env"):
        check.serve_check(tmp_path / "run", build_env=False)
    assert not (tmp_path / "run" / check.SERVE_CHECK_DIR).exists()


@pytest.mark.bad_input
@pytest.mark.integration
def test_heads_without_an_engine_format_are_refused_in_one_line(typed_cfg, tmp_path, monkeypatch):
    from tests.helpers import run_train
    from tests.test_cache import FAST

    run = tmp_path / "run"
    run_train(typed_cfg(*FAST, "heads=chained", f"hydra.run.dir={run}", f"paths.output_dir={run}"))
    monkeypatch.setattr(env, "check_cpu", lambda flags=None: {"avx2"})
    monkeypatch.setattr(env, "python", lambda root=None: tmp_path / "python")
    with pytest.raises(MtpError, match="chained heads have no engine format"):
        check.serve_check(run)


@pytest.mark.bad_input
def test_the_cli_names_the_problem_and_exits_2(tmp_path, capsys):
    from mtp_train.cli.serve_check import main

    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no run directory here" in capsys.readouterr().err
    assert main([str(tmp_path), "--rounds", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


@pytest.mark.bad_input
def test_an_engine_that_dies_at_start_is_named_with_its_log_and_leaves_no_process(tmp_path):
    import os
    import sys

    fake = tmp_path / "python"  # an "engine" whose worker prints and exits before it is ready
    fake.write_text(f"#!{sys.executable}\nimport sys, os\nprint('ValueError: no CPU backend here', file=sys.stderr)\n"
                    "os.fork() or __import__('time').sleep(60)\nsys.exit(3)\n")
    fake.chmod(0o755)
    with pytest.raises(MtpError, match=r"(?s)engine exited with code 3.*no CPU backend here"):
        w = check.EngineWorker(fake, {"engines": {}}, tmp_path / "engine.log")
        w.close()
    # the forked child (standing for the engine's own worker processes) was taken down with it
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    alive = [p for p in pids if str(fake) in _cmdline(p)]
    assert alive == []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_head_size_the_engines_cpu_attention_lacks_is_refused_in_one_line():
    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4)  # the default tiny backbone: 16
    with pytest.raises(MtpError, match=r"run/: the backbone: attention head size 16 .*supports only 32, 64"):
        check.check_head_size(cfg, "run/: the backbone")
    assert check.check_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=2), "x") == 32
    assert check.check_head_size(SimpleNamespace(hidden_size=576, num_attention_heads=9, head_dim=64), "x") == 64
