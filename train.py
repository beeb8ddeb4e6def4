"""Train a policy with BAPO (or a baseline): python train.py algo=bapo model=tiny

``python train.py <overrides> --plan [--nproc N] [--gpu-memory GiB]`` prints the run's memory plan
(per-GPU peaks of generation and of the update, host memory per node: ``bapo.plan``) and exits
without starting anything or creating a run folder."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from bapo.cli import guarded
    from bapo.loop import run

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    metrics = guarded(lambda: run(cfg, run_dir), run_dir)  # bad input: one line, exit 2; no folder left behind
    if "stopped_by_signal" in metrics:  # SIGTERM / Ctrl-C: checkpoint saved; say so the conventional way
        sys.exit(128 + int(metrics["stopped_by_signal"]))


if __name__ == "__main__":
    if "--plan" in sys.argv[1:]:  # composed by bapo.plan with the same overrides, before Hydra makes a run folder
        from bapo.plan import cli

        sys.exit(cli(sys.argv[1:]))
    from bapo.cli import hydra_entry

    hydra_entry(main)  # Hydra's own start-up errors (a bad override, an unwritable run folder): one line too
