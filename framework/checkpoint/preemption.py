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

import atexit
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from framework.checkpoint import store
from framework.errors import CheckpointError
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
        self.ignored_at_exit = False  # `_ignore_at_exit` is registered


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
    if not _requests.ignored_at_exit:
        atexit.register(_ignore_at_exit)
        _requests.ignored_at_exit = True


def _ignore_at_exit() -> None:
    """While the interpreter exits, TERM, USR1 and USR2 are ignored: the process's ending is
    decided (a signal noted before now was acted on), and Python gives the default action, death,
    back to every signal it handled on its way out, so a signal 0.3 s after a finished run's last
    checkpoint ended it by SIGTERM instead of 0."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


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
    """Whether any rank got a preemption signal, agreed on by every rank at the same calls.

    `poll()` is called by every rank at the same points of the loop (each step's end). How many
    calls lie between two agreeing ones is agreed in the same all-reduce (the smallest any rank
    proposes from its own step times: about every `AGREE_EVERY_S` seconds), so every rank polls at
    the same calls and sees the same answer there. Two ways to agree, by that interval:

    - **every call** (steps of ~`AGREE_EVERY_S` / 2 or more): the all-reduce is waited for at
      once, so a signal is acted on at the end of the step it came in: the checkpoint starts within
      one step of the signal, however long steps are (the wait costs < 0.3 % of such a step);
    - **every k calls** (shorter steps): a poll starts the all-reduce and returns the one started two
      such polls earlier, finished by then, so it costs no wait for the device (on CUDA the value
      comes back through pinned memory and an event); a signal is acted on within about three
      intervals (~0.75 s)."""

    def __init__(self, process: ProcessContext) -> None:
        self.process = process
        self._inflight: tuple[Any, torch.Tensor] | None = None  # (work, flag on the collective device)
        self._ready: tuple[Any, torch.Tensor] | None = None  # (event or None, flag in host memory)
        self._calls, self._next, self._every = 0, 0, 1  # calls so far; the next agreeing call; calls apart
        self._last, self._since = 0, time.perf_counter()  # the last agreeing call, and when it was

    def poll(self) -> bool:
        """The agreed flag (one process: this process's flag, now)."""
        mine = _requests.at is not None
        if not (self.process.world_size > 1 and dist.is_initialized()):
            return mine
        self._calls += 1
        if self._calls < self._next:
            return False
        waiting = self._every == 1  # agreed at the last agreeing call: the same on every rank
        agreed = self._read_ready()
        if self._inflight is not None:
            work, flag = self._inflight
            work.wait()
            self._inflight, self._ready = None, self._to_host(flag)
            if waiting:
                agreed = self._read_ready() or agreed
        now = time.perf_counter()
        per_call = (now - self._since) / max(1, self._calls - self._last)
        self._last, self._since, self._next = self._calls, now, self._calls + self._every
        proposal = max(1.0, AGREE_EVERY_S // max(per_call, 1e-6))
        flag = torch.tensor([1.0 if mine else 0.0, -proposal], device=self.process.collective_device)
        self._inflight = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        if waiting:  # slow steps: this call's answer now
            work, flag = self._inflight
            work.wait()
            self._inflight, self._ready = None, (None, flag.cpu())
            agreed = self._read_ready() or agreed
        return agreed

    def _to_host(self, flag: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """A finished all-reduce's flag on its way to host memory (CUDA: a pinned copy and its event)."""
        if not flag.is_cuda:
            return None, flag
        host = torch.empty_like(flag, device="cpu").pin_memory()
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event, host

    def _read_ready(self) -> bool:
        """The flag of the agreement that reached host memory (and the agreed interval it carries)."""
        if self._ready is None:
            return False
        event, host = self._ready
        if event is not None:
            event.synchronize()
        self._ready = None
        self._every = max(1, int(-host[1].item()))  # the same on every rank
        return bool(host[0].item())

    def drain(self) -> None:
        """Finish the all-reduce in flight (before the process group goes away)."""
        if self._inflight is not None:
            self._inflight[0].wait()
        self._inflight = self._ready = None


class Deadline:
    """What a preemption checkpoint needs against the time between the signal and the kill
    (`grace_s`: Slurm's KillWait, a pod's terminationGracePeriodSeconds): the step in progress
    when the signal comes and one save, both measured on this run. `late()` says once when they
    no longer fit; `report()` says how long after the signal the checkpoint was complete."""

    def __init__(self, grace_s: float | None) -> None:
        self.grace_s = grace_s
        self.step_s, self.save_s = 0.0, 0.0  # the slowest step and save measured so far
        self._last_step: float | None = None
        self._warned = False

    def step_ended(self) -> None:
        """Measure a step (the time since the previous call)."""
        now = time.perf_counter()
        if self._last_step is not None:
            self.step_s = max(self.step_s, now - self._last_step)
        self._last_step = now

    def saved(self, seconds: float) -> None:
        """Measure a save; a step's clock restarts after it."""
        self.save_s = max(self.save_s, seconds)
        self._last_step = time.perf_counter()

    def late(self) -> str | None:
        """One line, once, when a step and a save measured here exceed `grace_s`."""
        need = self.step_s + self.save_s
        if self.grace_s is None or self._warned or not self.save_s or need <= self.grace_s:
            return None
        self._warned = True
        return (
            f"a preemption checkpoint needs ~{need:.1f} s after the signal here (a step {self.step_s:.1f} s + a "
            f"save {self.save_s:.1f} s), more than trainer.checkpoint.grace_s={self.grace_s:g}: the kill would "
            "come first; signal earlier (sbatch --signal=USR1@<seconds>) or raise the grace time"
        )

    def report(self) -> str:
        """How long after the first signal the checkpoint was complete, and the margin left."""
        at = requested_at()
        if at is None:
            return ""
        took = time.time() - at
        margin = (
            "" if self.grace_s is None else f", {self.grace_s - took:.1f} s before grace_s={self.grace_s:g}"
        )
        return f" {took:.1f} s after the signal{margin}"


def last_checkpoint(ckpt_dir: Path) -> str:
    """'DIR/step_00000120 (step 120)': the newest complete checkpoint in `ckpt_dir`, or 'none'."""
    newest = store.complete_checkpoints(ckpt_dir)[-1:] if ckpt_dir.is_dir() else []
    try:
        step = store.read_meta(newest[0]).get("step") if newest else None
    except CheckpointError:
        step = "?"
    return f"{newest[0]} (step {step})" if newest else "none"


def exit_code(ckpt_dir: Path, since: float) -> int:
    """How a job whose workers did not survive a preemption signal ends: `EXIT_PREEMPTED` when they
    wrote a checkpoint for the preemption after `since` (the launch), 0 when the run's final one
    (it finished); otherwise 1, naming the last good checkpoint."""
    newest = store.complete_checkpoints(ckpt_dir)[-1:] if ckpt_dir.is_dir() else []
    try:
        meta = store.read_meta(newest[0]) if newest else {}
    except CheckpointError:
        meta = {}
    if meta.get("reason") in ("preempted", "end") and float(meta.get("time", 0)) >= since:
        return EXIT_PREEMPTED if meta["reason"] == "preempted" else 0
    print(
        f"Error: preempted ({signal_name()}) before a checkpoint could be saved; "
        f"last good checkpoint: {last_checkpoint(ckpt_dir)}",
        file=sys.stderr,
    )
    return 1
