"""The named sweep (experiment=ablation_staleness) and the SLURM launcher config compose."""

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from bapo.config import build
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf"
GRID = {"algo": "grpo,clip_higher,bapo", "learner.mini_batches_per_rollout": "1,3,5", "seed": "1,2,3"}


def _experiment(name: str) -> str:
    # `experiment=` needs an `experiment` entry in config.yaml's defaults list; without one it is appended
    listed = any("experiment" in str(d) for d in OmegaConf.load(CONF / "config.yaml").defaults)
    return f"experiment={name}" if listed else f"+experiment={name}"


def _compose(overrides, hydra_config=False):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_config)


def test_ablation_staleness_sweeps_the_grid():
    cfg = _compose([_experiment("ablation_staleness")], hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert params == GRID
    assert cfg.hydra.sweep.dir == "multirun/ablation_staleness"  # fixed: a re-launch reuses the run folders
    assert "experiment" in cfg.hydra.job.config.override_dirname.exclude_keys
    # the basic sweeper's parser sees a 3 x 3 x 3 grid
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    assert [len(list(o.sweep_iterator())) for o in parsed] == [3, 3, 3]
    assert cfg.buffer.max_staleness == 4 and cfg.logger.group == "ablation_staleness"


@pytest.mark.parametrize("algo,mini_batches", itertools.product(["grpo", "clip_higher", "bapo"], [1, 3, 5]))
def test_every_grid_point_validates(algo, mini_batches, tmp_path):
    overrides = [_experiment("ablation_staleness"), f"algo={algo}", f"learner.mini_batches_per_rollout={mini_batches}"]
    cfg = _compose([*overrides, "seed=2"])
    rc = build(cfg, tmp_path)
    assert rc.sizes.max_reuse_staleness == mini_batches - 1
    resolved = OmegaConf.to_container(cfg, resolve=True)
    report = load_script("study/report")
    assert report.staleness_of(resolved) == mini_batches - 1  # the report groups by the same number
    tags = [f"algo={algo}", "seed=2", f"mini_batches={mini_batches}", "ppo_epochs=1", "max_staleness=4"]
    assert resolved["logger"]["tags"] == tags  # wandb filters a sweep's runs by these


def test_slurm_launcher_composes_and_loads():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra is not installed")
    from hydra.utils import get_class

    cfg = _compose([_experiment("ablation_staleness"), "hydra/launcher=slurm"], hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    for key in ("partition", "gpus_per_node", "timeout_min", "cpus_per_task", "mem_gb", "nodes"):
        assert key in launcher, key
    assert launcher.gpus_per_node == 1 and launcher.nodes == 1
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"
