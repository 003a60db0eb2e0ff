"""How `Engine.fit` trains: its options, defined once and shared with the config tree.

`FitConfig` is `fit`'s keyword arguments. It is made of three groups of options, each a
dataclass of its own because the config tree (`framework.recipe.schema`) holds each group in
its own node, with the same names, types and defaults:

* `LoopConfig`   how long and how often: the `trainer` node;
* `LoaderConfig` how the training data is read: the `data` node;
* `SaveConfig`   how often checkpoints are kept: the `trainer.checkpoint` node;

and of what `fit` alone is given (where checkpoints go, preemption handling, the console).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from framework.data.streams import SHUFFLE_WINDOW
from framework.engine.arguments import options_of
from framework.errors import ConfigError

_OPTIONAL = ("steps_per_epoch", "max_steps", "valid_batch_size", "valid_steps")
_COUNTS = ("epochs", "batch_size", "valid_freq", "log_freq", *_OPTIONAL)


@dataclass
class LoopConfig:
    """How long `fit` trains and how often it validates and logs. `batch_size` is global: split
    over data-parallel ranks and accumulation steps."""

    epochs: int = 1  # passes over the training data
    batch_size: int = 1  # the global batch: split over data-parallel ranks and accumulation steps
    steps_per_epoch: int | None = None  # cap of optimizer steps per epoch
    valid_freq: int = 1  # validate every N epochs (when there is validation data)
    log_freq: int = 10  # optimizer steps between logged lines / metrics.jsonl records
    max_steps: int | None = None  # stop after this many optimizer steps
    valid_batch_size: int | None = None  # global batch of validation (default: batch_size)
    valid_steps: int | None = None  # cap the batches of a validation (default: all; a stream: to its end)
    valid_at_start: bool = False  # also validate before the first step (logged as start_val_*)
    # a rank without progress this long says so, with its threads' stacks, and the job ends
    # (instead of waiting in a collective for torch's 30-minute default); None: no watchdog
    timeout_s: float | None = None
    resume: str | None = None  # auto (the newest complete checkpoint in the checkpoints dir, if any) | PATH
    peak_tflops: float | None = None  # one device's peak for MFU (default: a table of GPUs, a CPU probe)

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                allowed = "a whole number >= 1" + (", or None" if name in _OPTIONAL else "")
                raise ConfigError.about("fit", name, value, f"{name} must be {allowed}")


@dataclass
class LoaderConfig:
    """How the training data is read."""

    shuffle: bool = True  # shuffle the training data each epoch (seeded by the engine's seed)
    shuffle_window: int = (
        SHUFFLE_WINDOW  # a stream's examples permuted at a time when shuffled (map-style: unused)
    )
    num_workers: int = 0  # DataLoader worker processes
    # a callable turning a list of samples into a batch (default: torch's); in a config tree a
    # `_target_` node, which is why it is typed Any
    collate_fn: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.shuffle_window, int) or self.shuffle_window < 0:
            raise ConfigError.about(
                "fit", "shuffle_window", self.shuffle_window, "a whole number of examples >= 0"
            )


@dataclass
class SaveConfig:
    """How often checkpoints are written and how many are kept."""

    save_freq: int = 0  # optimizer steps between checkpoints; 0: only when training ends
    keep_last_k: int | None = 3  # complete checkpoints kept (older ones deleted); 0 or None keeps all


@dataclass
class FitConfig(SaveConfig, LoaderConfig, LoopConfig):
    """How `fit` trains: `Engine.fit`'s keyword arguments (`LoopConfig`, `LoaderConfig`,
    `SaveConfig`, and the fields below). Training data that is a stream
    (`framework.data.streams`) needs `max_steps` (or `steps_per_epoch`); with `save_dir`, a
    checkpoint every `save_freq` optimizer steps, the newest `keep_last_k` kept; `resume`
    ("auto" or a path) continues one; `handle_preemption` saves and stops at the next step
    boundary after SIGTERM (`preemption_grace_s`: the seconds until the kill, which a measured
    step and save are checked against)."""

    save_dir: str | None = None  # checkpoints dir; None: no checkpoints
    handle_preemption: bool = (
        False  # save and stop at the next step boundary after SIGTERM / SIGUSR1 / SIGUSR2
    )
    # seconds from a preemption signal to the kill: a warning when a measured step and save exceed it
    preemption_grace_s: float | None = None
    # rank 0 prints progress as the CLI does, unless a ConsoleLogger is among the callbacks
    progress: bool = True

    def __post_init__(self) -> None:
        LoopConfig.__post_init__(self)
        LoaderConfig.__post_init__(self)
        grace = self.preemption_grace_s
        if grace is not None and (
            isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace <= 0
        ):
            raise ConfigError.about("fit", "preemption_grace_s", grace, "seconds > 0, or None")

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments (shallow: collate_fn stays the same object)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fit_config(config: FitConfig | None, options: dict[str, Any]) -> FitConfig:
    """`config` (or the defaults) with `options` replacing its fields; an unknown option is a
    ConfigError listing the valid ones."""
    options_of(FitConfig, options, "fit()")
    return replace(config or FitConfig(), **options)


def shared(group: type, node: dict[str, Any]) -> dict[str, Any]:
    """The options of `group` (one of the dataclasses above) that `node` (a config node) holds."""
    names = {f.name for f in fields(group)}
    return {k: v for k, v in node.items() if k in names}
