"""Train a model from the composed Hydra config.

python train.py                    # the default: MLP on the shipped digits data, CPU, seconds
python train.py +strategy=zero3    # the same under ZeRO stage 3
"""

import hydra
from omegaconf import DictConfig

from framework import cli


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Run one job; the returned value is what Hydra sweepers optimise."""
    return cli.run(cfg)


if __name__ == "__main__":
    cli.prepare_argv()
    main()
