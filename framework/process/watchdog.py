"""A rank that makes no progress for `trainer.timeout_s` says so, dumps the stacks of its threads
and exits 1, instead of waiting in a collective for torch's 30-minute default (DeepSpeed's own
process groups never get the timeout given to the default group).

Progress is a `beat()`: every training step, evaluation batch and finished checkpoint. Work that
may legitimately take longer without beating runs inside `suspended(factor)`: a checkpoint's save,
load or conversion (and the other ranks' wait for it) may take `LONG_WORK` x `timeout_s`; only a
local build that cannot hang on another rank (`factor=None`) is unbounded. A peer of this job
that is stopped (SIGSTOP) on this host is named and killed when the watchdog fires, so the
launcher need not wait for it. Under a launcher, the first rank to exit ends the job (torch elastic
stops the others), so a stuck job ends within about `timeout_s` (+ a few seconds).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

LONG_WORK = 4  # a checkpoint's save, load or conversion may take this many times timeout_s


class _Watch:
    """What this process's watchdog knows (one per process: it watches the process itself)."""

    def __init__(self) -> None:
        self.last = 0.0  # monotonic time of the last beat
        self.timeout = 0.0
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()


_lock = threading.Lock()
_state = _Watch()
_long: list[tuple[float | None, str]] = []  # the long work running now: (factor, what)
_peers: list[tuple[str, int]] = []  # every rank's (host, pid)


def beat() -> None:
    """Note progress (cheap: one clock read)."""
    _state.last = time.monotonic()


@contextlib.contextmanager
def suspended(factor: float | None = None, what: str = "long work") -> Iterator[None]:
    """While the block runs, `factor` x timeout_s without a beat is allowed (None, the default: no
    limit, for work that cannot wait on another rank, such as a JIT build); a beat when it starts
    and when it ends."""
    beat()
    with _lock:
        _long.append((factor, what))
    try:
        yield
    finally:
        with _lock:
            _long.remove((factor, what))
        beat()


def _limit() -> tuple[float | None, str]:
    """The idle time allowed now (None: unlimited) and what the long work is, if any."""
    with _lock:
        work = list(_long)
    if any(factor is None for factor, _ in work):
        return None, ""
    if not work:
        return _state.timeout, ""
    factor, what = max(work, key=lambda item: item[0] or 0)
    return float(factor or 1) * _state.timeout, what


def budget() -> float | None:
    """Seconds the long work running now may still take before the watchdog ends this rank (a
    subprocess given less can be stopped with a clearer message); None without a watchdog."""
    limit, _ = _limit()
    if not running() or limit is None:
        return None
    return max(1.0, 0.9 * limit - (time.monotonic() - _state.last))


def set_peers(processes: list[tuple[str, int]]) -> None:
    """Every rank's (host, pid), by rank (the process group gathers it when it forms)."""
    _peers[:] = processes


def stopped_peers() -> list[tuple[int, int]]:
    """(pid, rank) of this job's other processes on this host that are stopped (SIGSTOP or a
    debugger's stop: state T in Linux's /proc; [] elsewhere)."""
    host, found = socket.gethostname(), []
    for rank, (where, pid) in enumerate(_peers):
        if where != host or pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            found.append((pid, rank))
    return found


def end_stopped_peers() -> str:
    """Kill this job's stopped peers on this host (a stopped process never handles the launcher's
    SIGTERM: it would wait 30 s more); a sentence naming them, or ''."""
    peers = stopped_peers()
    for pid, _ in peers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    names = ", ".join(f"rank {rank} (pid {pid})" for pid, rank in peers)
    return f"; {names} {'is' if len(peers) == 1 else 'are'} stopped (SIGSTOP): ended" if peers else ""


def _watch(rank: int) -> None:
    while not _state.stop.wait(min(1.0, _state.timeout / 4)):
        idle = time.monotonic() - _state.last
        limit, what = _limit()
        if limit is None or idle < limit:
            continue
        time.sleep(0.3 * (rank % 8))  # ranks that time out together print one after another
        during = f" while {what} (allowed: {LONG_WORK} x trainer.timeout_s)" if what else ""
        print(
            f"Error: rank {rank} made no progress for {idle:.0f} s{during} (trainer.timeout_s={_state.timeout:g}): "
            "it is stuck (in a collective, waiting for another rank, or in its own code)"
            f"{end_stopped_peers()}; the stacks of its threads follow",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        # The other ranks stopped making progress at about the same time: give their watchdogs a
        # moment to show their stacks too before this exit makes the launcher stop them.
        time.sleep(min(3.0, _state.timeout / 4))
        for child in multiprocessing.active_children():  # loader workers: none outlives its rank
            with contextlib.suppress(OSError, ValueError):
                child.kill()
        os._exit(1)


def start(timeout_s: float, rank: int = 0) -> None:
    """Watch this process from now on (again: a new timeout, the clock restarted)."""
    _state.timeout = float(timeout_s)
    beat()
    if _state.thread is None or not _state.thread.is_alive():
        _state.stop.clear()
        _state.thread = threading.Thread(target=_watch, args=(rank,), name="hydraspeed-watchdog", daemon=True)
        _state.thread.start()


def stop() -> None:
    """Stop watching."""
    _state.stop.set()
    if _state.thread is not None:
        _state.thread.join(timeout=5)
    _state.thread = None


def running() -> bool:
    """True while a watchdog thread runs in this process."""
    return _state.thread is not None and _state.thread.is_alive()


@contextlib.contextmanager
def watching(timeout_s: float | None, rank: int = 0) -> Iterator[None]:
    """Watch this process while the block runs (nothing when `timeout_s` is None or a watchdog
    already runs: the outer one stays in charge)."""
    if timeout_s is None or running():
        yield
        return
    start(timeout_s, rank)
    try:
        yield
    finally:
        stop()
