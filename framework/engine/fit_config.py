"""`FitConfig`: how `Engine.fit` trains, the one home of its options and their defaults (the CLI
fills it from `trainer.*`, `Engine.fit` from its keyword arguments)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from framework.data.streams import SHUFFLE_WINDOW
from framework.engine.arguments import options_of
from framework.errors import ConfigError

_OPTIONAL = ("steps_per_epoch", "max_steps", "valid_batch_size", "valid_steps")


@dataclass
class FitConfig:
    """How `fit` trains: `Engine.fit`'s keyword arguments (the CLI fills them from `trainer.*`).

    `batch_size` is global; `steps_per_epoch` caps optimizer steps per epoch; `log_freq` is in
    optimizer steps; training data that is a stream (`framework.data.streams`) needs `max_steps`
    (or `steps_per_epoch`), is shuffled `shuffle_window` examples at a time when `shuffle` is on,
    and `valid_steps` caps the batches of a validation (default: the whole validation data); with `save_dir`, a checkpoint every `save_freq` optimizer steps (0: only at
    the end), the newest `keep_last_k` kept; `resume` ("auto" or a path) continues one;
    `handle_preemption` saves and stops at the next step boundary after SIGTERM (`preemption_grace_s`:
    the seconds until the kill, which a measured step and save are checked against); with `timeout_s`,
    a rank that makes no progress for that long says so, with its threads' stacks, and exits 1
    (instead of waiting in a collective for torch's 30-minute default)."""

    epochs: int = 1
    batch_size: int = 1
    steps_per_epoch: int | None = None
    valid_freq: int = 1
    log_freq: int = 10
    max_steps: int | None = None
    valid_batch_size: int | None = None
    shuffle: bool = True
    collate_fn: Callable | None = None
    num_workers: int = 0
    shuffle_window: int = SHUFFLE_WINDOW
    valid_steps: int | None = None
    valid_at_start: bool = False
    save_dir: str | None = None
    save_freq: int = 0
    keep_last_k: int | None = 3
    resume: str | None = None
    handle_preemption: bool = False
    preemption_grace_s: float | None = (
        None  # signal to kill: a measured step + save must fit (else a warning)
    )
    peak_tflops: float | None = None  # the device's peak for MFU (default: table / measured)
    timeout_s: float | None = None  # a rank without progress this long ends the job (watchdog)
    progress: bool = (
        True  # rank 0 prints progress as the CLI does, unless a ConsoleLogger is among the callbacks
    )

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "steps_per_epoch", "valid_freq", "log_freq", "max_steps",
                     "valid_batch_size", "valid_steps"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                allowed = "a whole number >= 1" + (", or None" if name in _OPTIONAL else "")
                raise ConfigError(f"fit({name}={value!r}): {name} must be {allowed}")
        grace = self.preemption_grace_s
        if grace is not None and (
            isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace <= 0
        ):
            raise ConfigError(f"fit(preemption_grace_s={grace!r}): seconds > 0, or None")
        if not isinstance(self.shuffle_window, int) or self.shuffle_window < 0:
            raise ConfigError(f"fit(shuffle_window={self.shuffle_window!r}): a whole number of examples >= 0")

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments (shallow: collate_fn stays the same object)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fit_config(config: FitConfig | None, options: dict[str, Any]) -> FitConfig:
    """`config` (or the defaults) with `options` replacing its fields; an unknown option is a
    ConfigError listing the valid ones."""
    options_of(FitConfig, options, "fit()")
    return replace(config or FitConfig(), **options)
