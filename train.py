"""Train a policy with BAPO (or a baseline): python train.py algo=bapo model=tiny"""

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


def _only_hydra_files(run_dir: Path) -> bool:
    """Nothing in the folder but what Hydra wrote at job start (.hydra/ and the job's log)."""
    return run_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from bapo.config import ConfigError
    from bapo.loop import run

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    fresh = not run_dir.exists() or _only_hydra_files(run_dir)
    try:
        metrics = run(cfg, run_dir)
    except ConfigError:
        if fresh and _only_hydra_files(run_dir):  # a config error leaves no run folder behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if "stopped_by_signal" in metrics:  # SIGTERM / Ctrl-C: checkpoint saved; say so the conventional way
        sys.exit(128 + int(metrics["stopped_by_signal"]))


if __name__ == "__main__":
    main()
