"""What the loop has done so far (`LoopState`) and what the run is (`RunInfo`).

No reference to the engine: callbacks and loggers read these, the checkpoint manager saves
`LoopState.state_dict()` and puts it back with `load_state_dict`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.errors import NonFiniteLoss


@dataclass
class RunInfo:
    """Facts about the run, fixed when training starts (for loggers and run files)."""

    model_name: str = ""
    parameters: int = 0
    trainable_parameters: int = 0  # of them, those the optimizer updates (an adapter run's few)
    strategy: str = ""  # Strategy.describe()
    world_size: int = 1
    device_type: str = "cpu"
    deepspeed_config: dict[str, Any] = field(default_factory=dict)  # what DeepSpeed received
    resumed_from: str | None = None  # the checkpoint this run continued, if any
    flops_per_step: float | None = None  # model FLOPs per optimizer step and rank (throughput.py)
    flops_source: str = ""  # how they were counted
    peak_flops: float | None = None  # one device's peak FLOP/s the MFU is relative to
    notes: list[str] = field(default_factory=list)  # limits that disagree, said once at the start


class LossMeter:
    """Sums step losses without reading them back from the device: the first read syncs once.

    Values may be tensors (kept on their device) or floats, each with the optimizer step it
    belongs to, so `first_non_finite()` can name the step where a NaN/inf appeared."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, int]] = []
        self.sum, self.count = 0.0, 0  # what earlier, already read values contributed

    def add(self, value: Any, step: int) -> None:
        """Add one step's loss."""
        self.pending.append((value.detach() if isinstance(value, torch.Tensor) else value, step))

    def _read(self) -> list[float]:
        values = [v for v, _ in self.pending]
        if values and all(isinstance(v, torch.Tensor) for v in values):
            return torch.stack([v.float().reshape(()) for v in values]).cpu().tolist()
        return [float(v) for v in values]

    def first_non_finite(self) -> tuple[int, float] | None:
        """(step, value) of the first pending NaN/inf, else None. Reads the pending values."""
        floats = self._read()
        self.pending = [(f, step) for f, (_, step) in zip(floats, self.pending)]
        return next(((step, f) for f, (_, step) in zip(floats, self.pending) if not math.isfinite(f)), None)

    def mean(self) -> float:
        """Mean of everything added since the last reset (0.0 when empty)."""
        self.sum += sum(self._read())
        self.count += len(self.pending)
        self.pending = []
        return self.sum / self.count if self.count else 0.0

    def reset(self) -> None:
        """Forget everything."""
        self.pending, self.sum, self.count = [], 0.0, 0

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (reads the pending values)."""
        self.mean()
        return {"sum": self.sum, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what `state_dict` returned."""
        self.pending, self.sum, self.count = [], float(state["sum"]), int(state["count"])

    def load_mean(self, states: list[dict[str, Any]]) -> None:
        """For a run on another number of ranks: every saving rank's `state_dict`, as their mean
        (the loss logged is the mean over ranks of each rank's mean, and every rank counts the
        same steps), so the mean over the new ranks continues the saving run's."""
        self.load_state_dict(
            {"sum": sum(float(s["sum"]) for s in states) / len(states), "count": states[0]["count"]}
        )


# Counters that a checkpoint saves and a resumed run puts back.
_SAVED = (
    "epoch",
    "global_step",
    "step_calls",
    "steps_in_epoch",
    "batches_in_epoch",
    "batches_fetched",
    "samples_seen",
    "skipped_steps",
    "records_written",
)


@dataclass
class LoopState:
    """What the loop has really done so far: the counters every callback and logger reads."""

    epoch: int = 0
    epochs: int = 1
    global_step: int = 0  # optimizer steps taken
    max_steps: int | None = None
    step_calls: int = 0  # calls of the step function in this epoch
    steps_in_epoch: int = 0  # optimizer steps taken in this epoch
    batches_in_epoch: int = 0  # batches fetched from the loader in this epoch
    batches_per_epoch: int | None = None  # known length of an epoch in batches
    batches_fetched: int = 0  # batches fetched over the whole run
    samples_seen: int = 0  # samples (global, all ranks) over the whole run
    skipped_steps: int = 0  # optimizer steps skipped by the fp16 loss scaler (overflow)
    skipped_batches: int = 0  # batches the training step skipped (returned None), all ranks, this run
    global_batch_size: int = 0
    epoch_loss: LossMeter = field(default_factory=LossMeter)  # this rank's step losses, this epoch
    window_loss: LossMeter = field(default_factory=LossMeter)  # ... since the last logged step
    loader_state: dict[str, Any] | None = None  # the loader's position after the last consumed batch
    records_written: int = 0  # metrics.jsonl lines so far (a resumed run keeps exactly these)
    logs: dict[str, Any] = field(default_factory=dict)
    log_now: bool = False  # this step's logs are a logging point (loss reduced over ranks)
    # what the training step sampled this step, for the completions file (a method's step_samples)
    samples: list[dict[str, Any]] = field(default_factory=list)
    history: dict[str, list[Any]] = field(default_factory=dict)
    stop_training: bool = False
    stop_reason: str = ""
    last_checkpoint: str | None = None
    checkpoints: dict[int, str] = field(default_factory=dict)  # step -> checkpoint written at it
    last_checkpoint_time: float = 0.0  # when it was written (time.time())
    elapsed_s: float = 0.0
    info: RunInfo = field(default_factory=RunInfo)

    def first_bad_loss(self) -> tuple[int, float] | None:
        """(step, value) of the first NaN/inf loss since the last logged step, else None."""
        return self.window_loss.first_non_finite()

    def good_checkpoint(self, bad_step: int) -> str | None:
        """The newest checkpoint of this run whose weights gave a finite loss: the loss of step s is
        computed with the weights saved after step s - 1, so a NaN at step s leaves step s - 2."""
        good = [step for step in self.checkpoints if step <= bad_step - 2]
        return self.checkpoints[max(good)] if good else None

    def poisoned_checkpoints(self, bad_step: int) -> list[str]:
        """This run's checkpoints whose weights (may) give the NaN of `bad_step`."""
        return [path for step, path in sorted(self.checkpoints.items()) if step >= bad_step - 1]

    def non_finite_error(self, bad_step: int, value: float) -> NonFiniteLoss:
        """The error for a NaN/inf loss first seen at `bad_step`, naming the last good checkpoint."""
        good = self.good_checkpoint(bad_step)
        return NonFiniteLoss(
            f"loss became {value} at step {bad_step} (epoch {self.epoch + 1}); training stopped, last good "
            f"checkpoint: {good or 'none'}. Try a lower optimizer.lr or strategy.gradient_clip.max_norm=1.0",
            step=bad_step,
        )

    def start_epoch(self) -> None:
        """Zero the per-epoch counters (the logging window goes on: a record covers the steps
        since the previous record, across epoch ends)."""
        self.batches_in_epoch = self.step_calls = self.steps_in_epoch = 0
        self.epoch_loss.reset()

    def state_dict(self) -> dict[str, Any]:
        """The counters, history, loss sums and loader position, as plain data."""
        return {
            "counters": {key: getattr(self, key) for key in _SAVED},
            "epoch_loss": self.epoch_loss.state_dict(),
            "window_loss": self.window_loss.state_dict(),
            "history": self.history,
            "loader_state": self.loader_state,
            "checkpoints": self.checkpoints,
        }

    def load_state_dict(self, state: dict[str, Any], with_position: bool = True) -> None:
        """Put back what `state_dict` returned; `with_position=False` leaves the loader position
        out (it does not map onto another world size)."""
        for key, value in state["counters"].items():
            setattr(self, key, value)
        self.epoch_loss.load_state_dict(state["epoch_loss"])
        self.window_loss.load_state_dict(state["window_loss"])
        self.history = state["history"]
        self.loader_state = state["loader_state"] if with_position else None
        self.checkpoints = {int(k): v for k, v in state.get("checkpoints", {}).items()}

    def load_loss_means(self, states: list[dict[str, Any]]) -> None:
        """The epoch's and the logging window's loss sums of every saving rank (`state_dict`s), as
        their mean: for a run on another number of ranks."""
        self.epoch_loss.load_mean([s["epoch_loss"] for s in states])
        self.window_loss.load_mean([s["window_loss"] for s in states])


TrainState = LoopState  # the name earlier versions used
