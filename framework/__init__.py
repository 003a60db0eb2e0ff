"""hydraspeed: PyTorch training composed from Hydra configs and executed by DeepSpeed.

The public API::

    from framework import Engine, Strategy, FitConfig, to_static, shard_dataloader, DistModel
    from framework import Callback, Event, Control, LoopState, ProcessContext, AdapterConfig
    from framework import build          # a config tree -> a run, as `python train.py` builds it
    from framework.methods import DPO, SimPO, ORPO, SFT   # training methods (`train_step=`)

Importing the framework changes no environment variable and imports neither DeepSpeed nor
Hydra; a run's process context is made when it starts (`ProcessContext.start`).
"""

from framework.engine import DistModel, Engine, FitConfig, shard_dataloader, to_static
from framework.errors import CheckpointError, ConfigError, NonFiniteLoss
from framework.integrations.peft import AdapterConfig
from framework.observe.callbacks import (
    Callback,
    Control,
    EarlyStopping,
    Event,
    KeepBest,
    LearningRateMonitor,
)
from framework.observe.state import LoopState, TrainState
from framework.plan.strategy import Strategy
from framework.process.context import ProcessContext
from framework.recipe import Run, build

__all__ = [
    "AdapterConfig",
    "Callback",
    "CheckpointError",
    "ConfigError",
    "Control",
    "DistModel",
    "EarlyStopping",
    "Engine",
    "Event",
    "FitConfig",
    "KeepBest",
    "LearningRateMonitor",
    "LoopState",
    "NonFiniteLoss",
    "ProcessContext",
    "Run",
    "Strategy",
    "TrainState",
    "build",
    "shard_dataloader",
    "to_static",
]
