"""The errors a run reports in one line (the CLI prints them without a traceback)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run, with a message that says what to write instead."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged or does not fit this run."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: training stops (the last good checkpoint stays).
    `step`: the optimizer step whose loss it was first, when known."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step
