"""Small objects that tests name in configs (`_target_: tests.helpers...`)."""

from __future__ import annotations

from framework import Callback, device


class RaiseOnRank(Callback):
    """Raise on one rank at one optimizer step: a worker failure in the middle of training."""

    def __init__(self, rank: int = 1, step: int = 3):
        self.rank, self.step = rank, step

    def on_step_end(self, state):
        if device.rank() == self.rank and state.global_step >= self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {state.global_step}")


class SlowDown(Callback):
    """Sleep after every step (numerics untouched): gives a test time to kill a run mid-way."""

    def __init__(self, seconds: float = 0.05):
        self.seconds = seconds

    def on_step_end(self, state):
        import time

        time.sleep(self.seconds)
