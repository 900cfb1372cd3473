"""Config tree: every experiment and group option composes; bad values fail naming the key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from mtp_train.config import validate
from mtp_train.entry import CONF_DIR
from mtp_train.errors import ConfigError

EXPERIMENTS = sorted(p.stem for p in Path(CONF_DIR, "experiment").glob("*.yaml"))
GROUP_OPTIONS = [(g, p.stem) for g in ("backbone", "heads", "loss", "data", "trainer", "logger")
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


def test_the_demo_experiment_is_the_default_and_the_makefile_runs_it():
    assert "smollm2_demo" in EXPERIMENTS
    assert "experiment: smollm2_demo" in Path(CONF_DIR, "config.yaml").read_text()
    assert "experiment=smollm2_demo" in Path(CONF_DIR).parent.joinpath("Makefile").read_text()


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
    """Without the default experiment's overlay, each value the option's file sets is composed."""
    cfg = validate(compose_cfg("~experiment", f"{group}={option}", *NEEDS.get((group, option), [])))
    if group not in ("trainer", "logger"):  # free-form sections: instantiated, not schema'd
        _assert_applied(cfg, _file_leaves(Path(CONF_DIR, group, f"{option}.yaml"), group))


def test_default_is_the_demo_on_smollm2_and_sharegpt(typed_cfg):
    cfg = typed_cfg()
    assert cfg.experiment_name == "smollm2_demo"
    assert (cfg.backbone.source, cfg.data.source) == ("gguf", "sharegpt")
    assert cfg.heads.type == "chained" and cfg.loss.name == "kl" and cfg.heads.init == "random"


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
def test_the_cli_refuses_an_added_unknown_key_in_one_line(tmp_path):
    r = _run("data_prep.cli", "backbone=tiny", "+heads.foo=3", cwd=tmp_path)
    assert r.returncode == 2 and "heads.foo: not a config key" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout and not (tmp_path / "data").exists()


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.bad_input
def test_cli_bad_value_is_one_clear_line(tmp_path):
    r = _run("data_prep.cli", "backbone=tiny", "heads.k=0", cwd=tmp_path)
    assert r.returncode == 2
    assert "heads.k: must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.bad_input
def test_cli_unknown_stage_names_the_key(tmp_path):
    r = _run("data_prep.cli", "backbone=tiny", "stage=train", cwd=tmp_path)
    assert r.returncode == 2
    assert "stage: mtp-prep has no stage 'train'" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("module", ["data_prep.cli", "mtp_train.cli.train", "mtp_train.cli.clp", "mtp_train.cli.eval"])
def test_every_entry_point_composes_the_config(tmp_path, module):
    r = _run(module, "backbone=tiny", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "tiny-llama" in r.stdout and "experiment_name: smollm2_demo" in r.stdout


def test_slurm_launcher_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "backbone=tiny"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.timeout_min > 0


@pytest.mark.parametrize("key,value,message", [
    ("val_check_interval", 0, "trainer.val_check_interval: 0; give a positive"),
    ("max_steps", "ten", "trainer.max_steps: 'ten' is not a number"),
    ("max_epochs", True, "trainer.max_epochs: True is not a number"),
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

    from mtp_train.entry import entry

    def task(cfg, typed):
        raise SIGTERMException  # what Lightning raises when the process gets SIGTERM

    with pytest.raises(SystemExit) as exit_:
        entry(task)(compose_cfg("backbone=tiny"))
    assert exit_.value.code == 143
    assert "stopped by SIGTERM" in capsys.readouterr().err


@pytest.mark.bad_input
def test_a_write_failure_is_one_line_naming_the_file(compose_cfg, capsys):
    import errno

    from mtp_train.entry import entry

    def task(cfg, typed):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/heads.safetensors.tmp")

    with pytest.raises(SystemExit) as exit_:
        entry(task)(compose_cfg("backbone=tiny"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: /data/run/heads.safetensors.tmp: No space left on device")


@pytest.mark.bad_input
@pytest.mark.parametrize("old,new", [("clp.taus=[0.9]", "clp.thresholds"), ("eval.span_tau=0.5", "eval.span_threshold")])
def test_the_clp_threshold_keys_renamed_from_tau_are_refused_naming_the_new_one(compose_cfg, old, new):
    """tau is the mean accepted length; the CLP probability threshold has its own name now."""
    with pytest.raises(ConfigError, match=rf"{old.split('=')[0]}: renamed to {new}"):
        validate(compose_cfg(old))
    validate(compose_cfg(f"{new}={old.split('=')[1]}"))  # the new key takes the same value
