"""The test process's composition memo (tests/helpers/config.py): a memoised composition is the composition."""

import shutil

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict

from tests.helpers import config as C
from tests.helpers.paths import ROOT


def composed(conf, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture()
def conf(tmp_path):
    out = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", out)
    return out


def test_the_memo_is_installed_and_a_repeat_is_a_hit(conf):
    from hydra._internal.hydra import Hydra

    assert Hydra.compose_config.memoised
    first = composed(conf, "algo=grpo")
    size = len(C._COMPOSED)
    again = composed(conf, "algo=grpo")
    assert len(C._COMPOSED) == size and again == first
    assert OmegaConf.is_struct(again)  # as Hydra returns it: unknown keys are refused
    assert composed(conf, "algo=bapo") != first and len(C._COMPOSED) == size + 1


def test_each_caller_gets_its_own_copy(conf):
    cfg = composed(conf, "seed=3")
    cfg.seed = 4
    with open_dict(cfg):
        cfg.extra = 1
    again = composed(conf, "seed=3")
    assert again.seed == 3 and "extra" not in again


def test_an_edited_yaml_is_composed_afresh(conf):
    assert composed(conf).seed == composed(conf).seed
    text = (conf / "config.yaml").read_text()
    seed = composed(conf).seed
    assert f"seed: {seed}\n" in text
    (conf / "config.yaml").write_text(text.replace(f"seed: {seed}\n", f"seed: {seed + 11}\n"))
    assert composed(conf).seed == seed + 11


def test_a_failure_is_raised_every_time(conf):
    for _ in range(2):
        with pytest.raises(HydraException, match="no_such_algo"):
            composed(conf, "algo=no_such_algo")
