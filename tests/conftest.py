"""Shared fixtures: Hydra composition against conf/, the tiny backbone built in code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mtp_train.cli.common import CONF_DIR  # registers the schemas
from mtp_train.config import BackboneConfig, TinyBackboneConfig
from mtp_train.config_rules import validate

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def compose_cfg(tmp_path):
    """compose_cfg(*overrides) -> DictConfig, with every path under tmp_path."""

    def _compose(*overrides):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=[
                f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}/out", *overrides])

    return _compose


@pytest.fixture
def typed_cfg(compose_cfg):
    return lambda *overrides: validate(compose_cfg(*overrides))


@pytest.fixture(scope="session")
def tiny_backbone():
    from mtp_train.backbone import load_backbone

    return load_backbone(BackboneConfig(name="tiny-llama", source="tiny", tiny=TinyBackboneConfig()))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from mtp_train.backbone import build_tiny_tokenizer

    return build_tiny_tokenizer()


class _Payload:
    """Unpickling it creates a file: stands for any code a planted pickle would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def planted(tmp_path):
    """(an object to plant in a checkpoint, the file that exists only if loading it ran code)."""
    marker = tmp_path / "payload-ran"
    return _Payload(marker), marker
