"""hydraspeed: PyTorch training composed from Hydra configs and executed by DeepSpeed.

Public API::

    from framework import Engine, Strategy, to_static, shard_dataloader
"""

from framework.process import context as _device

_device.configure_environment()  # before DeepSpeed picks its accelerator

from framework.engine.dist_model import DistModel, shard_dataloader, to_static  # noqa: E402
from framework.engine.engine import Engine  # noqa: E402
from framework.errors import CheckpointError, ConfigError, NonFiniteLoss  # noqa: E402
from framework.observe.callbacks import (  # noqa: E402
    Callback,
    Control,
    EarlyStopping,
    Event,
    KeepBest,
    LearningRateMonitor,
)
from framework.observe.state import LoopState, TrainState  # noqa: E402
from framework.plan.strategy import Strategy  # noqa: E402

__all__ = [
    "Callback",
    "CheckpointError",
    "ConfigError",
    "Control",
    "DistModel",
    "EarlyStopping",
    "Engine",
    "Event",
    "KeepBest",
    "LearningRateMonitor",
    "LoopState",
    "NonFiniteLoss",
    "Strategy",
    "TrainState",
    "shard_dataloader",
    "to_static",
]
