"""Configs as train.py composes them: the Hydra composition, the typed config, and a learner group."""

import dataclasses
from pathlib import Path

from tests.helpers.paths import ROOT


def compose(*overrides: str):
    """conf/config.yaml composed by Hydra with ``overrides``, as train.py would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return hydra_compose(config_name="config", overrides=list(overrides))


def smoke_cfg(overrides):
    """``compose`` of the smoke-sized debug run (``debug=smoke``) with the list ``overrides``."""
    return compose("debug=smoke", *overrides)


def run_config(*overrides: str, run_dir: str | Path = "/tmp/bapo-test-run"):
    """The typed config (``bapo.config.RunConfig``) of ``compose(*overrides)``."""
    from bapo.config import build

    return build(compose(*overrides), run_dir)


def learner_cfg(**fields):
    """The default ``learner=single`` group, typed, with ``fields`` replaced (``lr``, ``micro_batch_size``, ...)."""
    return dataclasses.replace(_default_learner(), **fields)


_LEARNER = []


def _default_learner():
    if not _LEARNER:
        _LEARNER.append(run_config("logger=none").learner)
    return _LEARNER[0]
