"""Preemption: SIGTERM (what Slurm sends before it stops a job), SIGUSR1 (the time-limit warning
of `sbatch --signal=USR1@60`) and SIGUSR2 (the one submitit asks Slurm for) ask for a checkpoint
at the next step boundary every rank agrees on, then an exit with `EXIT_PREEMPTED`.

Every signal after the first is absorbed too: Slurm signals the launcher and the workers
together and the launcher forwards its own, so a worker sees two; the second must not kill it
before it has saved. A preempted job exits `EXIT_PREEMPTED` only when a checkpoint newer than
the signal exists; under submitit, a USR1/USR2 then goes on to submitit's own handler, which
requeues the job (`submitit_requeue`), and the requeued attempt resumes from it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from framework.process.context import ProcessContext

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# Exit code of a job that stopped for a preemption signal after saving a checkpoint: "not done,
# resume me" (EX_TEMPFAIL). An sbatch script requeues on it; a sweep counts the job as preempted.
EXIT_PREEMPTED = 75


class _Requests:
    """This process's preemption requests (one per process: signals are delivered to a process)."""

    def __init__(self) -> None:
        self.at: float | None = None  # time of the first signal
        self.signum: int | None = None  # which one
        self.saved_step: int | None = None  # the preemption checkpoint's step, once saved


_requests = _Requests()
_previous: dict[int, Any] = {}  # the handlers ours replaced (submitit's among them)


def install_handler() -> None:
    """Note TERM, USR1 and USR2 (every one of them) instead of dying on them."""

    def handler(signum: int, frame: Any) -> None:
        note_requested(time.time(), signum)

    for signum in SIGNALS:
        before = signal.signal(signum, handler)
        if getattr(before, "__qualname__", "") != handler.__qualname__:
            _previous[signum] = before


def note_requested(at: float, signum: int) -> None:
    """Record a preemption request (a signal here, or one a worker reported to its launcher)."""
    if _requests.at is None:
        _requests.at, _requests.signum = at, signum


def requested_at() -> float | None:
    """When this process first got a preemption signal (None: it did not)."""
    return _requests.at


def signal_name() -> str:
    """The first preemption signal's name (SIGTERM when none came)."""
    return signal.Signals(_requests.signum or signal.SIGTERM).name


def _submitit_handler() -> Callable[[int, Any], None] | None:
    """submitit's checkpoint-and-requeue handler, where submitit started this process."""
    for signum in (signal.SIGUSR2, signal.SIGUSR1):
        for candidate in (_previous.get(signum), signal.getsignal(signum)):
            owner: Any = getattr(candidate, "__self__", None)
            requeue = getattr(owner, "checkpoint_and_try_requeue", None)
            if requeue is not None and type(owner).__module__.startswith("submitit."):
                return requeue  # type: ignore[no-any-return]
    return None


def submitit_requeue() -> Callable[[], None] | None:
    """After a USR1/USR2 save under submitit: submitit's own handler, which requeues the job
    through its checkpoint protocol (`max_num_timeout` bounds the time-limit requeues) and exits.
    None when there is nothing to hand over to (not under submitit, or SIGTERM: a cancellation,
    or a preemption that Slurm requeues by itself)."""
    handler, signum = _submitit_handler(), _requests.signum
    if handler is None or signum not in (signal.SIGUSR1, signal.SIGUSR2):
        return None
    return lambda: handler(signum, None)


def note_saved(step: int) -> None:
    """The run stopped for preemption after saving a checkpoint of `step` (every rank)."""
    _requests.saved_step = step


def saved_step() -> int | None:
    """The step of the preemption checkpoint this process's run saved (None: it was not preempted)."""
    return _requests.saved_step


def report() -> tuple[float | None, int | None, int | None]:
    """This process's preemption state, for its launcher (`adopt`)."""
    return _requests.at, _requests.signum, _requests.saved_step


def adopt(state: tuple[float | None, int | None, int | None]) -> None:
    """Take on a worker's preemption state (`report`): the launcher ends the job as it would."""
    at, signum, step = state
    if at is not None and signum is not None:
        note_requested(at, signum)
    if step is not None:
        note_saved(step)


# About how often, in seconds of training, the ranks agree on whether a signal came (each
# agreement is a collective: on the CPU it costs a step ~0.3 ms whatever it carries).
AGREE_EVERY_S = 0.25


class Agreement:
    """Whether any rank got a preemption signal, agreed on by every rank without stalling the step.

    `poll()` is called by every rank at the same points of the loop (each step's end). About
    every `AGREE_EVERY_S` seconds of them, a poll starts an all-reduce of this rank's flag and
    returns the result started two such polls earlier: by then it has finished, so reading it
    costs no wait for the device (on CUDA the value comes back through pinned memory and an
    event). How many calls lie between two such polls is agreed in the same all-reduce (the
    smallest any rank proposes, from its own step times), so every rank polls at the same calls
    and sees the same answer there; a signal is acted on within about three such intervals."""

    def __init__(self, process: ProcessContext) -> None:
        self.process = process
        self._inflight: tuple[Any, torch.Tensor] | None = None  # (work, flag on the collective device)
        self._ready: tuple[Any, torch.Tensor] | None = None  # (event or None, flag in host memory)
        self._calls, self._next, self._every = 0, 0, 1  # calls so far; the next agreeing call; calls apart
        self._last, self._since = 0, time.perf_counter()  # the last agreeing call, and when it was

    def poll(self) -> bool:
        """The agreed flag as of two agreeing calls ago (one process: this process's flag, now)."""
        mine = _requests.at is not None
        if not (self.process.world_size > 1 and dist.is_initialized()):
            return mine
        self._calls += 1
        if self._calls < self._next:
            return False
        agreed = False
        if self._ready is not None:
            event, host = self._ready
            if event is not None:
                event.synchronize()
            agreed = bool(host[0].item())
            self._every = max(1, int(-host[1].item()))  # the same on every rank
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
        now = time.perf_counter()
        per_call = (now - self._since) / max(1, self._calls - self._last)
        self._last, self._since, self._next = self._calls, now, self._calls + self._every
        proposal = max(1.0, AGREE_EVERY_S // max(per_call, 1e-6))
        flag = torch.tensor([1.0 if mine else 0.0, -proposal], device=self.process.collective_device)
        self._inflight = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return agreed

    def drain(self) -> None:
        """Finish the all-reduce in flight (before the process group goes away)."""
        if self._inflight is not None:
            self._inflight[0].wait()
        self._inflight = self._ready = None
