"""The Paddle-shaped API and the loops behind it: `Engine`, `DistModel` / `to_static`, `fit`,
`evaluate`, `predict`, the fine-grained `dataloader -> prepare -> run`, step flavours, and the one
place a model is made (`construct`: build -> adapt -> partition, for the CLI and the API alike).

Rule: imports every package below it (`errors`, `process`, `integrations`, `plan`, `data`,
`backend`, `observe`, `checkpoint`), never Hydra or DeepSpeed. The loops work against a small
`Host` protocol and never import the `Engine` class (`engine` and `dist_model` are the only
facades).
"""

from framework.engine.dist_model import DistModel, shard_dataloader, to_static
from framework.engine.engine import Engine
from framework.engine.fit_config import FitConfig

__all__ = ["DistModel", "Engine", "FitConfig", "shard_dataloader", "to_static"]
