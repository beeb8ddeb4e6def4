"""Train a policy with BAPO (or a baseline): python train.py algo=bapo model=tiny"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from bapo.loop import run

    run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
