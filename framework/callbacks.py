"""The named events of a training run and the callbacks that react to them.

Where each event fires in `Engine.fit`::

    FIT_START
    for each epoch:
        EPOCH_START
        for each training step (one call of the step function, any number of batches):
            STEP_START          before the call (a call that finds the epoch over has no STEP_END)
            STEP_END            state.logs holds the step's loss/lr/... ; set state.stop_training to stop
        VALIDATION_END          after validation, state.logs holds val_* (only when validation ran)
        EPOCH_END               state.logs holds the epoch summary; state.history is updated
        CHECKPOINT_SAVED        whenever a checkpoint was written (state.last_checkpoint)
    FIT_END

A callback overrides `on_<event>` (e.g. `on_step_end`) for the events it cares about.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from framework.engine import Engine


class Event(str, Enum):
    """A point in the training loop where callbacks run."""

    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    STEP_START = "step_start"
    STEP_END = "step_end"
    VALIDATION_END = "validation_end"
    EPOCH_END = "epoch_end"
    CHECKPOINT_SAVED = "checkpoint_saved"
    FIT_END = "fit_end"


@dataclass
class TrainState:
    """What the loop has really done so far: the counters every callback and logger reads."""

    engine: Engine | None = None
    epoch: int = 0
    epochs: int = 1
    global_step: int = 0  # optimizer steps taken
    max_steps: int | None = None
    step_calls: int = 0  # calls of the step function in this epoch
    batches_in_epoch: int = 0  # batches fetched from the loader in this epoch
    batches_per_epoch: int | None = None  # known length of an epoch in batches
    batches_fetched: int = 0  # batches fetched over the whole run
    samples_seen: int = 0  # samples (global, all ranks) over the whole run
    global_batch_size: int = 0
    epoch_loss_sum: float = 0.0  # this rank's step losses so far this epoch (for the epoch mean)
    epoch_loss_count: int = 0
    window_loss_sum: float = 0.0  # ... since the last logged step
    window_loss_count: int = 0
    loader_state: dict[str, Any] | None = None  # the loader's position after the last consumed batch
    records_written: int = 0  # metrics.jsonl lines so far (a resumed run keeps exactly these)
    logs: dict[str, Any] = field(default_factory=dict)
    log_now: bool = False  # this step's logs are a logging point (loss reduced over ranks)
    history: dict[str, list[Any]] = field(default_factory=dict)
    stop_training: bool = False
    stop_reason: str = ""
    last_checkpoint: str | None = None
    elapsed_s: float = 0.0


class Callback:
    """Base class: override the `on_<event>` methods you need; the rest do nothing."""

    def on_event(self, event: Event, state: TrainState) -> None:
        """Dispatch `event` to `on_<event>`."""
        getattr(self, f"on_{event.value}")(state)

    def on_fit_start(self, state: TrainState) -> None:
        """Before the first epoch."""

    def on_epoch_start(self, state: TrainState) -> None:
        """Before the first step of an epoch."""

    def on_step_start(self, state: TrainState) -> None:
        """Before each call of the step function."""

    def on_step_end(self, state: TrainState) -> None:
        """After each call of the step function."""

    def on_validation_end(self, state: TrainState) -> None:
        """After validation at the end of an epoch."""

    def on_epoch_end(self, state: TrainState) -> None:
        """After an epoch and its validation."""

    def on_checkpoint_saved(self, state: TrainState) -> None:
        """After a checkpoint was written."""

    def on_fit_end(self, state: TrainState) -> None:
        """After training ended (normally, by max_steps, or stopped by a callback)."""


class EarlyStopping(Callback):
    """Stop training when `monitor` has not improved by `min_delta` for `patience` validations."""

    def __init__(
        self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_epochs = 0

    def on_validation_end(self, state: TrainState) -> None:
        """Compare the monitored value with the best so far."""
        value = state.logs.get(self.monitor)
        if value is None:
            return
        better = (
            value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        )
        if better:
            self.best, self.bad_epochs = float(value), 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            state.stop_training = True
            state.stop_reason = (
                f"early stopping: {self.monitor} did not improve for {self.patience} validation(s)"
            )


class LearningRateMonitor(Callback):
    """Record the learning rate of every optimizer step into `state.history['lr_step']`."""

    def on_step_end(self, state: TrainState) -> None:
        """Append the current learning rate."""
        if "lr" in state.logs:
            state.history.setdefault("lr_step", []).append(state.logs["lr"])


class KeepBest(Callback):
    """Keep the weights of the best validation so far, by `monitor`, as consolidated fp32
    weights in `output_dir/filename` (every rank takes part: ZeRO-3 weights are gathered)."""

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "min",
        filename: str = "best.safetensors",
        output_dir: str | None = None,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"KeepBest mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode, self.filename, self.output_dir = monitor, mode, filename, output_dir
        self.best: float | None = None
        self.path: str | None = None

    def on_validation_end(self, state: TrainState) -> None:
        """Save when the monitored value improved."""
        value = state.logs.get(self.monitor)
        if value is None or state.engine is None or not math.isfinite(value):
            return
        if self.best is not None and (value >= self.best if self.mode == "min" else value <= self.best):
            return
        import os

        self.best = float(value)
        self.path = os.path.join(self.output_dir or ".", self.filename)
        state.engine.save(self.path, training=False)
        state.history.setdefault(f"best_{self.monitor}", []).append(self.best)
