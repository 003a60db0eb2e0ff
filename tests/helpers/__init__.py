"""Small objects that tests name in configs (`_target_: tests.helpers...`)."""

from __future__ import annotations

from framework import Callback
from framework.process.environment import env_rank


class RaiseOnRank(Callback):
    """Raise on one rank at one optimizer step: a worker failure in the middle of training."""

    def __init__(self, rank: int = 1, step: int = 3):
        self.rank, self.step = rank, step

    def on_step_end(self, state):
        if env_rank() == self.rank and state.global_step >= self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {state.global_step}")


class StopTrainingOnRank(Callback):
    """Ask training to stop on one rank only (a callback on a wall-clock budget or a rank's own
    values), at the end of optimizer step `step`, or with `epoch` at the end of that epoch."""

    def __init__(self, rank: int = 1, step: int | None = None, epoch: int | None = None):
        self.rank, self.step, self.epoch = rank, step, epoch

    def on_step_end(self, state):
        if env_rank() == self.rank and state.global_step == self.step:
            state.stop_training, state.stop_reason = True, f"asked on rank {self.rank}"

    def on_epoch_end(self, state):
        if env_rank() == self.rank and state.epoch + 1 == self.epoch:
            state.stop_training, state.stop_reason = True, f"asked on rank {self.rank}"


class StallOnRank(Callback):
    """Hang one rank at one optimizer step (a rank stuck in its own code)."""

    def __init__(self, rank: int = 1, step: int = 3):
        self.rank, self.step = rank, step

    def on_step_end(self, state):
        import time

        while env_rank() == self.rank and state.global_step >= self.step:
            time.sleep(1)


class KillRank(Callback):
    """SIGKILL one rank at one optimizer step (a worker the OS killed)."""

    def __init__(self, rank: int = 1, step: int = 3):
        self.rank, self.step = rank, step

    def on_step_end(self, state):
        import os
        import signal

        if env_rank() == self.rank and state.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class StopRank(Callback):
    """Stop this process (SIGSTOP, as a debugger or a frozen node would) at `step` on `rank`."""

    def __init__(self, rank: int = 1, step: int = 3, marker: str | None = None):
        self.rank, self.step, self.marker = rank, step, marker

    def on_step_end(self, state):
        import os
        import signal
        import time

        if env_rank() == self.rank and state.global_step == self.step:
            if self.marker:  # when it stopped, for a test that measures how long the job took to end
                with open(self.marker, "w") as f:
                    f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


class SlowDown(Callback):
    """Sleep after every step (numerics untouched): gives a test time to kill a run mid-way."""

    def __init__(self, seconds: float = 0.05):
        self.seconds = seconds

    def on_step_end(self, state):
        import time

        time.sleep(self.seconds)


def read_wandb_run(path) -> list:
    """The protobuf records of a wandb offline run file (`run-*.wandb`): a 7-byte header, then a
    LevelDB-style log (32 KiB blocks; each chunk: crc32c, little-endian length, type)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a wandb run file"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records
