"""Preemption: SIGTERM (what Slurm sends before it stops a job) asks for a checkpoint at the next
step boundary, then a clean exit.

Every SIGTERM after the first is absorbed too: Slurm signals the launcher and the workers
together and torch elastic forwards the launcher's, so a worker sees two; the second must not
kill it before it has saved. A preempted job exits 0 only when a checkpoint newer than the
signal exists (`saved_since_signal`).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from framework import device as dev

_requested_at: float | None = None  # time of the first SIGTERM


def install_handler() -> None:
    """Note SIGTERM (every one of them) instead of dying on it."""

    def handler(signum: int, frame: Any) -> None:
        global _requested_at
        if _requested_at is None:
            _requested_at = time.time()

    signal.signal(signal.SIGTERM, handler)


def requested_at() -> float | None:
    """When this process first got SIGTERM (None: it did not)."""
    return _requested_at


class Agreement:
    """Whether any rank got SIGTERM, agreed on by every rank without stalling the step.

    Each `poll()` (every rank calls it at the same points of the loop) starts an all-reduce of
    this rank's flag and returns the result started two polls earlier: by then it has finished,
    so reading it costs no wait for the device (on CUDA the value comes back through pinned
    memory and an event). Every rank sees the same answer at the same poll."""

    def __init__(self) -> None:
        self._inflight: tuple[Any, torch.Tensor] | None = None  # (work, flag on the collective device)
        self._ready: tuple[Any, torch.Tensor] | None = None  # (event or None, flag in host memory)

    def poll(self) -> bool:
        """The agreed flag as of two polls ago (one process: this process's flag, now)."""
        mine = _requested_at is not None
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        agreed = False
        if self._ready is not None:
            event, host = self._ready
            if event is not None:
                event.synchronize()
            agreed = bool(host.item())
            self._ready = None
        if self._inflight is not None:
            work, flag = self._inflight
            work.wait()
            if flag.is_cuda:
                host = torch.empty_like(flag, device="cpu").pin_memory()
                host.copy_(flag, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._ready = (event, host)
            else:
                self._ready = (None, flag)
        flag = torch.tensor([1.0 if mine else 0.0], device=dev.collective_device())
        self._inflight = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return agreed

    def drain(self) -> None:
        """Finish the all-reduce in flight (before the process group goes away)."""
        if self._inflight is not None:
            self._inflight[0].wait()
        self._inflight = self._ready = None
