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
    from bapo.checkpoint import CheckpointError
    from bapo.config import ConfigError
    from bapo.learner.learner import TrainingDiverged
    from bapo.loop import run
    from bapo.rundir import RunFolderBusy

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    fresh = not run_dir.exists() or _only_hydra_files(run_dir)
    try:
        metrics = run(cfg, run_dir)
    except (ConfigError, RunFolderBusy, CheckpointError, TrainingDiverged) as e:
        if fresh and _only_hydra_files(run_dir):  # a config error leaves no run folder behind
            shutil.rmtree(run_dir, ignore_errors=True)
        # the message names the key / folder / checkpoint: a stack trace would only bury it
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, (ConfigError, RunFolderBusy)) else 1)
    if "stopped_by_signal" in metrics:  # SIGTERM / Ctrl-C: checkpoint saved; say so the conventional way
        sys.exit(128 + int(metrics["stopped_by_signal"]))


if __name__ == "__main__":
    main()
