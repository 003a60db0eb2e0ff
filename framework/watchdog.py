"""A rank that makes no progress for `trainer.timeout_s` says so, dumps the stacks of its threads
and exits 1, instead of waiting in a collective for torch's 30-minute default (DeepSpeed's own
process groups never get the timeout given to the default group).

Progress is a `beat()`: every training step, evaluation batch and finished checkpoint. Work that
may legitimately take long without beating (a checkpoint save, a conversion) runs inside
`suspended()`. Under a launcher, the first rank to exit ends the job (torch elastic stops the
others), so a stuck job ends within about `timeout_s`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator

_lock = threading.Lock()
_state = {"last": 0.0, "timeout": 0.0, "suspended": 0}
_thread: threading.Thread | None = None
_stop = threading.Event()


def beat() -> None:
    """Note progress (cheap: one clock read)."""
    _state["last"] = time.monotonic()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No timeout while the block runs (long work that cannot beat); a beat when it ends."""
    with _lock:
        _state["suspended"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["suspended"] -= 1
        beat()


def _watch(rank: int) -> None:
    while not _stop.wait(min(1.0, _state["timeout"] / 4)):
        idle = time.monotonic() - _state["last"]
        if _state["suspended"] or idle < _state["timeout"]:
            continue
        time.sleep(0.3 * (rank % 8))  # ranks that time out together print one after another
        print(
            f"Error: rank {rank} made no progress for {idle:.0f} s (trainer.timeout_s={_state['timeout']:g}): "
            "it is stuck (in a collective, waiting for another rank, or in its own code); the stacks of its "
            "threads follow",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        # The other ranks stopped making progress at about the same time: give their watchdogs a
        # moment to show their stacks too before this exit makes the launcher stop them.
        time.sleep(min(5.0, _state["timeout"] / 4))
        os._exit(1)


def start(timeout_s: float, rank: int = 0) -> None:
    """Watch this process from now on (again: a new timeout, the clock restarted)."""
    global _thread
    _state["timeout"] = float(timeout_s)
    beat()
    if _thread is None or not _thread.is_alive():
        _stop.clear()
        _thread = threading.Thread(target=_watch, args=(rank,), name="hydraspeed-watchdog", daemon=True)
        _thread.start()


def stop() -> None:
    """Stop watching."""
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=5)
    _thread = None


def running() -> bool:
    """True while a watchdog thread runs in this process."""
    return _thread is not None and _thread.is_alive()


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
