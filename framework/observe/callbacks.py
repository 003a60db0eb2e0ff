"""The named events of a training run and the callbacks that react to them.

Where each event fires in `Engine.fit`::

    FIT_START
    for each epoch:
        EPOCH_START
        for each training step (one call of the step function, any number of batches):
            STEP_START          before the call (a call that finds the epoch over has no STEP_END)
            STEP_END            state.logs holds batches and lr, and at logging points (state.log_now,
                                every log_freq steps) the window's loss and throughput;
                                set state.stop_training to stop
        VALIDATION_END          after validation, state.logs holds val_* (only when validation ran)
        EPOCH_END               state.logs holds the epoch summary; state.history is updated
        CHECKPOINT_SAVED        whenever a checkpoint was written (state.last_checkpoint)
    FIT_END

A callback overrides `on_<event>` (e.g. `on_step_end`) for the events it cares about. A
handler gets the `LoopState` (what the loop has done) and, if it takes a second argument, a
`Control`: the few things a callback may ask of the run (stop it, save a checkpoint, write the
weights). Callbacks never see the Engine.

A stop asked between steps on some ranks only must reach the others, or they would wait in the
next step's collectives: when a run has a callback with a step-level handler (`on_step_start`,
`on_step_end`, `on_checkpoint_saved`) or a training step of the user's own, the ranks agree on
stopping at every optimizer step (one small all-reduce). A callback that never stops training
between steps, or stops it on every rank at the same step, says so with `stops_alike = True`
and the run saves that collective; stops at an epoch's end are agreed on in any case.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from framework.errors import ConfigError
from framework.observe.state import LoopState, TrainState


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


class Control:
    """What a callback may ask of the run. `save_weights(path)` writes the consolidated weights
    (every rank takes part: call it from a handler that runs on every rank); `save_checkpoint()`
    writes a resumable checkpoint now (only when the run has a checkpoint dir)."""

    def __init__(
        self,
        state: LoopState,
        save_weights: Callable[[str], Any] | None = None,
        save_checkpoint: Callable[[], Any] | None = None,
    ):
        self._state = state
        self._save_weights, self._save_checkpoint = save_weights, save_checkpoint

    def stop(self, reason: str) -> None:
        """End training after this step (the loop finishes the step, then FIT_END runs)."""
        self._state.stop_training, self._state.stop_reason = True, reason

    def save_weights(self, path: str) -> Any:
        """Write the model's consolidated weights to `path` (collective)."""
        if self._save_weights is None:
            raise ConfigError("this run cannot write weights from a callback")
        return self._save_weights(path)

    def save_checkpoint(self) -> Any:
        """Write a resumable checkpoint now (collective)."""
        if self._save_checkpoint is None:
            raise ConfigError(
                "this run has no checkpoint dir (fit(save_dir=...) or trainer.checkpoint.enabled)"
            )
        return self._save_checkpoint()


_TAKES_CONTROL: dict[tuple[type, str], bool] = {}


def _takes_control(owner: type, name: str) -> bool:
    """Whether `owner.name` is a handler with a second argument after the state (cached)."""
    key = (owner, name)
    if key not in _TAKES_CONTROL:
        try:
            params = inspect.signature(getattr(owner, name)).parameters.values()
            positional = [p for p in params if p.kind != p.VAR_KEYWORD]
            _TAKES_CONTROL[key] = len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in positional)
        except (TypeError, ValueError):
            _TAKES_CONTROL[key] = False
    return _TAKES_CONTROL[key]


class Callback:
    """Base class: override the `on_<event>` methods you need; the rest do nothing. A callback
    with `rank_zero_only = True` (the loggers) runs on rank 0 alone; others run on every rank."""

    rank_zero_only = False
    # True: never asks a stop between steps on some ranks only (see the module doc)
    stops_alike = False

    def on_event(self, event: Event, state: LoopState, control: Control | None = None) -> None:
        """Dispatch `event` to `on_<event>` (with `control` when the handler takes it)."""
        name = f"on_{event.value}"
        handler = getattr(self, name)
        if control is not None and _takes_control(type(self), name):
            handler(state, control)
        else:
            handler(state)

    def on_fit_start(self, state: LoopState) -> None:
        """Before the first epoch."""

    def on_epoch_start(self, state: LoopState) -> None:
        """Before the first step of an epoch."""

    def on_step_start(self, state: LoopState) -> None:
        """Before each call of the step function."""

    def on_step_end(self, state: LoopState) -> None:
        """After each call of the step function."""

    def on_validation_end(self, state: LoopState) -> None:
        """After validation at the end of an epoch."""

    def on_epoch_end(self, state: LoopState) -> None:
        """After an epoch and its validation."""

    def on_checkpoint_saved(self, state: LoopState) -> None:
        """After a checkpoint was written."""

    def on_fit_end(self, state: LoopState) -> None:
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

    def on_validation_end(self, state: LoopState) -> None:
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

    stops_alike = True  # never stops training between steps

    def on_step_end(self, state: LoopState) -> None:
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
        if os.sep in filename or (os.altsep and os.altsep in filename) or filename in ("", ".", ".."):
            raise ConfigError(
                f"keep_best.filename={filename!r} must be a plain file name (it is written inside the run dir)"
            )
        self.monitor, self.mode, self.filename, self.output_dir = monitor, mode, filename, output_dir
        self.best: float | None = None
        self.path: str | None = None

    def on_validation_end(self, state: LoopState, control: Control) -> None:  # type: ignore[override]
        """Save when the monitored value improved."""
        value = state.logs.get(self.monitor)
        if value is None or not math.isfinite(value):
            return
        if self.best is not None and (value >= self.best if self.mode == "min" else value <= self.best):
            return
        self.best = float(value)
        self.path = os.path.join(self.output_dir or ".", self.filename)
        control.save_weights(self.path)
        state.history.setdefault(f"best_{self.monitor}", []).append(self.best)


STEP_EVENTS = (Event.STEP_START, Event.STEP_END, Event.CHECKPOINT_SAVED)


def may_stop_alone(callback: Callback) -> bool:
    """Whether `callback` could ask a stop between steps on some ranks only: it handles a
    step-level event (or every event) and does not declare `stops_alike`."""
    if getattr(callback, "stops_alike", False):
        return False
    kind = type(callback)
    if getattr(kind, "on_event", Callback.on_event) is not Callback.on_event:
        return True
    return any(
        getattr(kind, f"on_{e.value}", None) is not getattr(Callback, f"on_{e.value}") for e in STEP_EVENTS
    )


class CallbackList:
    """The run's callbacks, fired in order with one `Control`; `agree_each_step`: whether the
    ranks agree on stopping at every optimizer step (see the module doc; the loop sets it)."""

    def __init__(self, callbacks: Iterable[Callback] = ()):
        self.callbacks: list[Callback] = list(callbacks)
        self.control: Control | None = None
        self.agree_each_step = True

    def extend(self, callbacks: Iterable[Callback]) -> None:
        """Add callbacks after the existing ones."""
        self.callbacks.extend(callbacks)

    def fire(self, event: Event, state: LoopState) -> None:
        """Run every callback's handler for `event`."""
        for callback in self.callbacks:
            callback.on_event(event, state, self.control)


__all__ = [
    "Callback",
    "CallbackList",
    "Control",
    "EarlyStopping",
    "Event",
    "KeepBest",
    "LearningRateMonitor",
    "LoopState",
    "TrainState",
]
