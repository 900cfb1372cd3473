"""Config tree: every experiment and group option composes; bad values fail naming the key."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from mtp_train.cli.common import CONF_DIR
from mtp_train.config_rules import validate
from mtp_train.errors import ConfigError

EXPERIMENTS = sorted(p.stem for p in Path(CONF_DIR, "experiment").glob("*.yaml"))
GROUP_OPTIONS = [(g, p.stem) for g in ("backbone", "heads", "loss", "data", "trainer", "logger", "debug")
                 for p in sorted(Path(CONF_DIR, g).glob("*.yaml"))]
NEEDS = {("backbone", "hf"): ["backbone.name=my-llm", "backbone.path=/models/llm"],
         ("data", "jsonl"): ["data.path=/tmp/x.jsonl"], ("data", "disk"): ["data.path=/tmp/ds"]}


def _leaves(node, prefix: str = "") -> dict:
    """Dotted key -> value of every plain leaf of a YAML file's content (interpolations, required
    values and the defaults list left out)."""
    out = {}
    for key, value in (node or {}).items():
        if key == "defaults" or (isinstance(value, str) and ("${" in value or value == "???")):
            continue
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _file_leaves(path: Path, package: str) -> dict:
    from omegaconf import OmegaConf  # reads numbers as Hydra does (PyYAML takes 1e-3 for a string)

    if "# @package _global_" in path.read_text():
        package = ""
    content = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return _leaves(content, f"{package}." if package else "")


def _assert_applied(cfg, leaves: dict) -> None:
    from omegaconf import OmegaConf

    node = OmegaConf.structured(cfg)
    for key, value in leaves.items():
        if key.startswith("hydra."):  # Hydra's own settings (a sweep's params): tests/test_sweep.py
            continue
        got = OmegaConf.select(node, key)
        assert got == value or (isinstance(value, (int, float)) and got == pytest.approx(value)), \
            f"{key}: the file sets {value!r}, the composed config has {got!r}"


def test_no_experiment_by_default_and_the_makefile_names_the_demo_in_every_command():
    assert "smollm2_demo" in EXPERIMENTS
    assert "  - experiment: null\n" in Path(CONF_DIR, "config.yaml").read_text()
    make = Path(CONF_DIR).parent.joinpath("Makefile").read_text()
    demo = make[make.index("\ndemo:"):]
    demo = demo[: demo.index("\n\n")]  # the recipe: up to the first blank line
    commands = [line for line in demo.splitlines() if "/bin/mtp-" in line and "mtp-report" not in line]
    assert len(commands) == 5 and all("experiment=smollm2_demo" in c for c in commands), commands


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("backbone", ["smollm2", "tiny"])
def test_every_experiment_composes_and_its_values_win(compose_cfg, experiment, backbone):
    """Each value an experiment file sets is the composed value (the overlay comes last), also
    with backbone=tiny switching the data source."""
    cfg = validate(compose_cfg(f"experiment={experiment}", f"backbone={backbone}"))
    assert cfg.experiment_name == experiment
    _assert_applied(cfg, _file_leaves(Path(CONF_DIR, "experiment", f"{experiment}.yaml"), ""))


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_composes_with_its_values(compose_cfg, group, option):
    """Each value the option's file sets is composed (no experiment overlay by default)."""
    cfg = validate(compose_cfg(f"{group}={option}", *NEEDS.get((group, option), [])))
    if group not in ("trainer", "logger"):  # free-form sections: instantiated, not schema'd
        _assert_applied(cfg, _file_leaves(Path(CONF_DIR, group, f"{option}.yaml"), group))


def test_the_default_is_the_schema_recipe_not_the_demo(typed_cfg):
    """Your own model gets the schema's recipe; the demo's sizing (its draft vocabulary, steps and
    data mix) comes only with experiment=smollm2_demo."""
    cfg = typed_cfg()
    assert cfg.experiment_name == "default"
    assert (cfg.backbone.source, cfg.data.source) == ("gguf", "sharegpt")
    assert cfg.heads.type == "chained" and cfg.loss.name == "kl" and cfg.heads.init == "random"
    assert cfg.heads.draft_vocab is None and cfg.loss.topk == 0 and cfg.train.data_use == "distilled"
    assert cfg.trainer["max_steps"] == 300
    user = typed_cfg("backbone=hf", "backbone.name=my-llm", "backbone.path=/models/llm")
    assert user.heads.draft_vocab is None and user.train.max_length is None
    demo = typed_cfg("experiment=smollm2_demo")
    assert (demo.heads.draft_vocab, demo.train.data_use, demo.trainer["max_steps"]) == (4096, "mix", 250)


def test_the_smoke_overlay_is_the_tiny_backbone_for_a_few_steps(typed_cfg):
    cfg = typed_cfg("debug=smoke")
    assert (cfg.backbone.source, cfg.data.source, cfg.logger) == ("tiny", "tiny", {})
    assert cfg.trainer["max_steps"] == 4
    assert typed_cfg("debug=smoke", "logger=csv").logger  # a command-line group choice still wins
    demo = typed_cfg("experiment=smollm2_demo", "debug=smoke")  # the demo's recipe, tiny and short
    assert (demo.backbone.source, demo.heads.draft_vocab, demo.trainer["max_steps"]) == ("tiny", 4096, 4)


@pytest.mark.parametrize("override", ["loss.name=mse", "loss.depth_weights=[1.0]", "train.batch_size=0",
                                      "train.lr_schedule=step", "heads.k=0", "heads.draft_vocab=1",
                                      "train.lr=inf", "train.lr=nan", "train.weight_decay=inf",
                                      "train.adam_betas=[0.9,1.0]", "train.adam_betas=[0.9]"])
@pytest.mark.bad_input
def test_train_refuses_a_bad_training_value_that_eval_and_clp_never_read(compose_cfg, override):
    """mtp-eval and mtp-clp take the heads' settings from the trained run (heads.json) and train
    nothing: a bad loss, train or heads value is theirs to ignore, and mtp-train's to refuse."""
    raw = compose_cfg("backbone=tiny", override)
    with pytest.raises(ConfigError, match=rf"^{override.split('=')[0]}"):
        validate(raw, command="train")
    with pytest.raises(ConfigError):
        validate(raw)  # no command: every key is judged
    for command in ("eval", "clp"):
        assert validate(raw, command=command).eval.modes == ["greedy", "verify"]


@pytest.mark.bad_input
def test_a_bad_trainer_value_stops_mtp_train_only(compose_cfg):
    from mtp_train.distributed import check_trainer

    typed = validate(compose_cfg("backbone=tiny", "trainer.max_steps=0"), command="eval")  # no Trainer there
    with pytest.raises(ConfigError, match=r"^trainer.max_steps: 0 trains nothing"):
        check_trainer(typed.trainer, gpus=0, cpus=2)  # what mtp-train checks before it builds one


@pytest.mark.parametrize("override,command", [("eval.rounds=0", "eval"), ("eval.max_new_tokens=0", "clp"),
                                              ("clp.kinds=[]", "clp"), ("data.val_fraction=2", "eval"),
                                              ("train.data_use=web", "clp"), ("train.data_use=web", "prep")])
@pytest.mark.bad_input
def test_each_command_refuses_a_bad_value_of_a_key_it_reads(compose_cfg, override, command):
    with pytest.raises(ConfigError, match=rf"^{override.split('=')[0]}"):
        validate(compose_cfg("backbone=tiny", override), command=command)


@pytest.mark.bad_input
@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_stage_is_refused_by_the_commands_that_have_none(compose_cfg, command):
    """hostile round 4: `mtp-train stage=bogus` (or stage=fit, meant for mtp-clp) ran the whole training."""
    with pytest.raises(ConfigError, match=rf"^stage: mtp-{command} has no stages, got stage='bogus'"):
        validate(compose_cfg("backbone=tiny", "stage=bogus"), command=command)
    validate(compose_cfg("backbone=tiny", "stage=all"), command=command)
    validate(compose_cfg("backbone=tiny", "stage=fit"), command="clp")  # mtp-clp's stages are its own


def test_mtp_clp_judges_only_the_eval_keys_its_calibration_reads(compose_cfg):
    validate(compose_cfg("backbone=tiny", "eval.warmup=-1"), command="clp")  # a timing setting it never uses
    # what its deadline sizing prices: the evaluation's modes, prompts, rounds and sampled runs
    with pytest.raises(ConfigError, match=r"^eval.rounds"):
        validate(compose_cfg("backbone=tiny", "eval.rounds=0"), command="clp")
    with pytest.raises(ConfigError, match=r"^budget.margin_min"):
        validate(compose_cfg("backbone=tiny", "budget.margin_min=-1"), command="clp")


def test_mtp_train_judges_eval_keys_only_when_it_decodes_after_training(compose_cfg):
    validate(compose_cfg("backbone=tiny", "eval.rounds=0"), command="train")
    with pytest.raises(ConfigError, match=r"^eval.rounds"):
        validate(compose_cfg("backbone=tiny", "eval.rounds=0", "train.eval_after=true"), command="train")


@pytest.mark.bad_input
def test_each_entry_point_validates_as_its_own_command(compose_cfg, monkeypatch, capsys):
    """The entry wrapper names the command after the entry point's file (cli/eval.py: eval)."""
    import mtp_train.cli.eval as cli_eval
    import mtp_train.cli.train as cli_train
    from mtp_train.config_rules import READS

    for command in READS:
        assert Path(CONF_DIR).parent.joinpath("mtp_train", "cli", f"{command}.py").is_file(), command
    raw = compose_cfg("backbone=tiny", "loss.name=mse")
    seen = []
    monkeypatch.setattr(cli_eval, "run_eval", seen.append)
    cli_eval.app(raw)  # Hydra's decorator passes a given config straight to the task
    assert [typed.loss.name for typed in seen] == ["mse"]
    monkeypatch.setattr(cli_train, "run_train", lambda typed: pytest.fail("trained on a bad loss.name"))
    with pytest.raises(SystemExit) as exit_:
        cli_train.app(raw)
    assert exit_.value.code == 2 and "loss.name: unknown value 'mse'" in capsys.readouterr().err


@pytest.mark.parametrize("k,crop,fits", [(3, 5, True), (3, 4, False), (1, 3, True), (1, 2, False)])
def test_k_fits_rows_of_k_plus_2_tokens(k, crop, fits):
    """Depth k at position t predicts token t + k + 1: the row needs positions t and t + k + 1."""
    from mtp_train.config_rules import check_k_fits, min_row_tokens

    assert min_row_tokens(k) == k + 2
    if fits:
        check_k_fits(k, crop, "rows of test")
    else:
        with pytest.raises(ConfigError, match=rf"^heads.k: {k} heads need rows of at least {k + 2} tokens"):
            check_k_fits(k, crop, "rows of test")


def test_tiny_backbone_brings_its_own_data(typed_cfg):
    cfg = typed_cfg("backbone=tiny")
    assert cfg.backbone.source == "tiny" and cfg.data.source == "tiny"
    # ...unless the user asks for other data
    assert typed_cfg("backbone=tiny", "data=sharegpt").data.source == "sharegpt"


@pytest.mark.parametrize("override,key", [
    ("heads.k=0", "heads.k"),
    ("heads.k=-2", "heads.k"),
    ("heads.type=eagle", "heads.type"),
    ("heads.lm_head=tied", "heads.lm_head"),
    ("heads.lm_head=copy", "heads.lm_head"),  # chained modules share the LM head
    ("loss.name=mse", "loss.name"),
    ("loss.segment_rule=magic", "loss.segment_rule"),
    ("loss.depth_weights=[1.0,0.5]", "loss.depth_weights"),  # k=3 needs three
    ("data.max_length=-5", "data.max_length"),
    ("data.max_conversations=0", "data.max_conversations"),
    ("data.val_fraction=1.5", "data.val_fraction"),
    ("data.distill.max_new_tokens=0", "data.distill.max_new_tokens"),
    ("data.distill.max_prompt_tokens=-1", "data.distill.max_prompt_tokens"),
    ("data.distill.top_p=0", "data.distill.top_p"),
    ("backbone.dtype=int8", "backbone.dtype"),
    ("backbone.device=tpu", "backbone.device"),
    ("data.min_val_rows=0", "data.min_val_rows"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.data_use=web", "train.data_use"),
    ("data.max_length=3", "heads.k"),  # k=3 leaves no target in 3 tokens
    ("train.max_length=4", "heads.k"),  # nor in rows cropped to 4
    ("heads.k=17", "heads.k"),  # the tree statistics would not fit
    ("clp.label_split=test", "clp.label_split"),
    ("eval.rounds=0", "eval.rounds"),
    ("eval.prompt_source=train", "eval.prompt_source"),
    ("eval.prompt_source=unseen eval.prompts=p.jsonl", "eval.prompt_source"),
    # the second bad-input round
    ("seed=100000000000000", "seed"),
    ("data.seed=-1", "data.seed"),
    ("data.distill.seed=-3", "data.distill.seed"),
    ("train.num_workers=-1", "train.num_workers"),
    ("loss.depth_weights=[0,0,0]", "loss.depth_weights"),
    ("clp.kinds=[]", "clp.kinds"),
    ("clp.kinds=[clp,clp]", "clp.kinds"),
    ("heads=medusa heads.share=true", "heads.share"),
    # the third round: nan compares false, so an entropy mask at theta=nan never fired
    ("loss.theta=nan", "loss.theta"),
    ("loss.zscore_threshold=inf", "loss.zscore_threshold"),
])
@pytest.mark.bad_input
def test_bad_values_are_rejected_naming_the_key(typed_cfg, override, key):
    with pytest.raises(ConfigError) as err:
        typed_cfg(*override.split())
    assert str(err.value).startswith(key), str(err.value)


@pytest.mark.bad_input
def test_jsonl_without_path_is_rejected(typed_cfg):
    with pytest.raises(ConfigError, match="data.path"):
        typed_cfg("data=jsonl")


@pytest.mark.parametrize("override,expected", [
    ("heads.k=abc", "heads.k"),
    ("data.max_length=long", "data.max_length"),
])
@pytest.mark.bad_input
def test_wrong_types_fail_at_compose_naming_the_key(compose_cfg, override, expected):
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_cfg(override)
    assert expected in str(err.value) or expected in str(err.value.__cause__)


@pytest.mark.bad_input
def test_unknown_key_fails_at_compose(compose_cfg):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as err:
        compose_cfg("heads.depth=3")
    assert "depth" in str(err.value) or "depth" in str(err.value.__cause__)


@pytest.mark.parametrize("added,key,section", [("+heads.foo=3", "heads.foo", "keys of heads: "),
                                                ("+foo=3", "foo", "keys of the top level: "),
                                                ("+data.distill.tempo=1", "data.distill.tempo", "keys of data.distill: ")])
@pytest.mark.bad_input
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused(compose_cfg, added, key, section):
    """Hydra's own error for `heads.foo=3` suggests `+heads.foo=3`, which composes: validation stops it."""
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(added))
    assert str(err.value).startswith(f"{key}: not a config key ({section}")


@pytest.mark.bad_input
@pytest.mark.integration
def test_the_cli_refuses_an_added_unknown_key_in_one_line(tmp_path):
    r = _run("mtp_train.cli.prep", "backbone=tiny", "+heads.foo=3", cwd=tmp_path)
    assert r.returncode == 2 and "heads.foo: not a config key" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout and not (tmp_path / "data").exists()


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.bad_input
@pytest.mark.integration
def test_cli_bad_value_is_one_clear_line(tmp_path):
    r = _run("mtp_train.cli.prep", "backbone=tiny", "data.max_length=0", cwd=tmp_path)
    assert r.returncode == 2
    assert "data.max_length: must be > 0" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.bad_input
@pytest.mark.integration
def test_cli_unknown_stage_names_the_key(tmp_path):
    r = _run("mtp_train.cli.prep", "backbone=tiny", "stage=train", cwd=tmp_path)
    assert r.returncode == 2
    assert "stage: mtp-prep has no stage 'train'" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("module", ["mtp_train.cli.prep", "mtp_train.cli.train", "mtp_train.cli.clp", "mtp_train.cli.eval"])
@pytest.mark.integration
def test_every_entry_point_composes_the_config(tmp_path, module):
    r = _run(module, "backbone=tiny", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "tiny-llama" in r.stdout and "experiment_name: default" in r.stdout


def test_slurm_launcher_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "backbone=tiny"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.timeout_min > 0


@pytest.mark.parametrize("key,value,message", [
    ("val_check_interval", 0, "trainer.val_check_interval: 0; give a whole positive number of training steps"),
    ("val_check_interval", 0.5, "trainer.val_check_interval: 0.5; give a whole positive number of training steps"),
    ("max_steps", "ten", "trainer.max_steps: 'ten' is not a number"),
    ("max_epochs", True, "trainer.max_epochs: True is not a number"),
    ("max_steps", -1, "trainer.max_steps: -1 leaves the length of training to trainer.max_epochs, which is None "
                      "(Lightning would then train 1000 epochs)"),
    ("gradient_clip_val", -1, "trainer.gradient_clip_val: -1; give a finite number >= 0"),
    ("precision", "64-true", "trainer.precision: '64-true'; the heads train in one of auto, 32-true"),
    ("precision", "garbage", "trainer.precision: 'garbage'; the heads train in one of auto, 32-true"),
    ("gradient_clip_val", float("inf"), "trainer.gradient_clip_val: inf; give a finite number >= 0"),
])
@pytest.mark.bad_input
def test_trainer_settings_of_the_wrong_kind_are_refused_naming_the_key(key, value, message):
    from mtp_train.distributed import check_trainer

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_trainer({"max_steps": 6, key: value}, gpus=0, cpus=2)


@pytest.mark.bad_input
def test_a_cuda_device_without_cuda_is_refused_naming_the_key(monkeypatch):
    import torch

    from mtp_train.backbone import load_backbone
    from mtp_train.config import BackboneConfig
    from mtp_train.errors import BackboneError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackboneError, match="backbone.device: cuda asked, but this torch sees no CUDA GPU"):
        load_backbone(BackboneConfig(name="t", source="tiny", device="cuda"))


@pytest.mark.bad_input
def test_sigterm_exits_143_with_a_line_saying_how_to_resume(compose_cfg, capsys):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from mtp_train.cli.common import entry

    def task(cfg, typed):
        raise SIGTERMException  # what Lightning raises when the process gets SIGTERM

    with pytest.raises(SystemExit) as exit_:
        entry(task)(compose_cfg("backbone=tiny"))
    assert exit_.value.code == 143
    assert "stopped by SIGTERM" in capsys.readouterr().err


@pytest.mark.bad_input
def test_a_write_failure_is_one_line_naming_the_file(compose_cfg, capsys):
    import errno

    from mtp_train.cli.common import entry

    def task(cfg, typed):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/heads.safetensors.tmp")

    with pytest.raises(SystemExit) as exit_:
        entry(task)(compose_cfg("backbone=tiny"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: /data/run/heads.safetensors.tmp: No space left on device")


@pytest.mark.parametrize("override,key", [
    ("eval.sampling.temperatures=[-0.5]", "eval.sampling.temperatures"),
    ("eval.sampling.temperatures=[inf]", "eval.sampling.temperatures"),
    ("eval.sampling.temperatures=[nan]", "eval.sampling.temperatures"),
    ("eval.sampling.top_p=0", "eval.sampling.top_p"), ("eval.sampling.top_p=1.5", "eval.sampling.top_p"),
    ("eval.sampling.top_k=-1", "eval.sampling.top_k"), ("eval.sampling.min_p=2", "eval.sampling.min_p"),
    ("eval.sampling.samples=0", "eval.sampling.samples"),
    ("eval.sampling.modes=[clp]", "eval.sampling.modes"),  # commits drafts unverified: cannot sample
    ("eval.sampling.modes=[tree]", "eval.sampling.modes"),  # not among eval.modes
])
@pytest.mark.bad_input
def test_bad_sampling_settings_are_refused_in_one_line_naming_the_key(compose_cfg, override, key):
    raw = compose_cfg("backbone=tiny", "eval.modes=[greedy,verify,clp]", override)
    with pytest.raises(ConfigError, match=rf"^{key}: ") as err:
        validate(raw, command="eval")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["[0]", "[-1.0]", "[0.7,0]"])
@pytest.mark.bad_input
def test_a_sampled_metric_temperature_must_be_positive(compose_cfg, value):
    with pytest.raises(ConfigError, match=r"^train.sampled_tau_temperatures: each must be > 0"):
        validate(compose_cfg("backbone=tiny", f"train.sampled_tau_temperatures={value}"), command="train")


@pytest.mark.bad_input
def test_a_full_disk_is_one_line_however_the_writing_library_reports_it(compose_cfg, capsys):
    """safetensors reports a full disk as SafetensorError, pyarrow as an OSError without errno: each
    is still one line and exit 2 from a command, and other errors are not mistaken for it."""
    import errno

    from safetensors import SafetensorError

    from mtp_train.cli.common import entry, write_failure

    full = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                           'message: "No space left on device" })')
    assert "No space left on device" in write_failure(full)
    assert "Read-only file system" in write_failure(OSError("Read-only file system: /runs/x"))
    assert write_failure(OSError(errno.ENOSPC, "No space left on device", "/runs/x/heads.safetensors")) == \
        "/runs/x/heads.safetensors: No space left on device"
    assert write_failure(ValueError("shapes differ")) is None
    # hostile round 4: a full disk during Lightning's checkpoint save surfaced as torch's zip writer error
    short = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 10048 vs 9984")
    assert write_failure(short).startswith("torch.save could not write a checkpoint, the disk is probably full")
    assert "file write failed" in write_failure(RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed"))
    assert write_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None

    def task(cfg, typed):
        raise full

    with pytest.raises(SystemExit) as stop:
        entry(task)(compose_cfg("backbone=tiny"))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: SafetensorError: No space left on device") and len(err.splitlines()) == 1


@pytest.mark.bad_input
def test_a_root_that_is_a_file_is_named_not_a_manifest_below_it(typed_cfg, compose_cfg, tmp_path):
    """MTP_ROOT set to a file: the error blamed distilled/manifest.json below it (hostile round 3)."""
    precious = tmp_path / "precious.txt"
    precious.write_text("keep")
    with pytest.raises(ConfigError, match=r"^paths\.root_dir: .*precious\.txt is a file, not a directory "
                                          r"\(paths\.root_dir comes from \$MTP_ROOT"):
        typed_cfg(f"paths.root_dir={precious}")
    # hostile round 4: the commands did not judge paths.*, so the manifest below was still blamed
    for command in ("prep", "train", "clp", "eval"):
        with pytest.raises(ConfigError, match=r"^paths\.root_dir: .*precious\.txt is a file"):
            validate(compose_cfg("backbone=tiny", f"paths.root_dir={precious}"), command=command)
    assert precious.read_text() == "keep"


@pytest.mark.bad_input
def test_a_bad_wandb_key_and_an_error_wandb_raises_are_one_line(compose_cfg, monkeypatch, capsys, caplog):
    """A 6-character WANDB_API_KEY, or W&B's server out of reach, ended in W&B's tracebacks (hostile
    round 3): the key is refused naming it before any login, and what W&B raises is one line, exit 2."""
    from mtp_train.cli.common import entry
    from mtp_train.tracking import offline_without_key

    monkeypatch.setenv("WANDB_API_KEY", "abc123")
    with pytest.raises(ConfigError, match=r"^WANDB_API_KEY: has 6 characters, and W&B keys have 40 or more"):
        offline_without_key()
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)  # a machine's own proxy would skip the probe
    monkeypatch.setenv("WANDB_MODE", "online")  # recorded, so the teardown undoes what the code sets
    monkeypatch.delenv("WANDB_MODE")
    with socket.create_server(("127.0.0.1", 0)) as server:  # a server that answers: online
        port = server.getsockname()[1]
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
        assert offline_without_key() is False and "WANDB_MODE" not in os.environ
    # W&B's server out of reach (a compute node without internet): offline at once, said in one
    # warning, where wandb.init waited 90 s and raised
    # the same port, closed now
    with caplog.at_level(logging.WARNING, logger="mtp_train.tracking"):
        assert offline_without_key() is True and os.environ["WANDB_MODE"] == "offline"
    assert "cannot be reached from this machine" in caplog.text and "logging offline" in caplog.text
    from mtp_train.tracking import server_out_of_reach

    monkeypatch.setenv("WANDB_BASE_URL", f"127.0.0.1:{port}")  # no scheme: still that host and port
    assert server_out_of_reach(timeout=1.0) == f"127.0.0.1:{port} cannot be reached from this machine (Connection refused)"
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # behind a proxy only W&B can tell
    assert server_out_of_reach(timeout=1.0) is None
    for bad in ("http://host:99999", "http://host:abc", "http://"):
        monkeypatch.setenv("WANDB_BASE_URL", bad)
        with pytest.raises(ConfigError, match=r"^WANDB_BASE_URL='" + re.escape(bad) + "': not a server address"):
            server_out_of_reach(timeout=1.0)
    comm_error = type("CommError", (Exception,), {"__module__": "wandb.errors.errors"})

    def task(cfg, typed):
        raise comm_error("Failed to get resume status for run x: context deadline exceeded\nwhile retrying: ...")

    with pytest.raises(SystemExit) as stop:
        entry(task)(compose_cfg("backbone=tiny"))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: W&B: CommError: Failed to get resume status for run x") and "WANDB_MODE=offline" in err
