"""What a short trial run measures for autotune: this process's peak memory from a starting point
and the wall time of optimizer steps after a warm-up.

* On a GPU the peak is `torch.cuda.max_memory_allocated` over what was allocated at the start
  (after the allocator's cache is emptied): the tensors of this run only.
* On a CPU it is the peak resident set (Linux's `VmHWM`, reset through `/proc/self/clear_refs`)
  over the resident set at the start, after the C allocator handed freed memory back to the OS:
  everything the run made resident, tensors, DeepSpeed's buffers and the allocator's slack alike.
  Where the peak cannot be reset, the process's lifetime peak stands in (a fresh worker's is its
  run's).
"""

from __future__ import annotations

import ctypes
import gc
import re
import resource
import sys
import time
from pathlib import Path

import torch

from framework.observe.callbacks import Callback
from framework.observe.state import LoopState

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def _return_free_heap() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


class PeakMemory:
    """This process's peak memory since `reset()` (see the module doc); `cuda`: measure the
    current CUDA device's allocations instead of the resident set."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.start = 0
        self.resettable = False

    def reset(self) -> None:
        """Start measuring here."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return
        _return_free_heap()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.resettable = True
        except OSError:
            self.resettable = False
        self.start = (_status_kib("VmRSS") or 0) * 1024

    def peak_bytes(self) -> int:
        """Bytes of the peak since `reset()` over what was held then."""
        if self.cuda:
            torch.cuda.synchronize()
            return max(0, torch.cuda.max_memory_allocated() - self.start)
        peak = _status_kib("VmHWM") if self.resettable else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return max(0, peak * 1024 - self.start)


class StepClock(Callback):
    """Wall time per optimizer step after the first `warmup` steps (the device synchronised at
    each step's end when `cuda`: a trial may pay that, a run never does)."""

    stops_alike = True  # never stops training between steps

    def __init__(self, warmup: int = 2, cuda: bool = False):
        self.warmup, self.cuda = max(1, int(warmup)), cuda
        self.ends: list[float] = []
        self._step = -1

    def on_step_end(self, state: LoopState) -> None:
        if state.global_step == self._step:
            return  # a step call that did not reach an optimizer step
        self._step = state.global_step
        if self.cuda:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def seconds_per_step(self) -> float | None:
        """Mean seconds of the steps after the warm-up; None with too few steps to tell."""
        timed = len(self.ends) - self.warmup
        if timed < 1:
            return None
        return (self.ends[-1] - self.ends[self.warmup - 1]) / timed
