"""Calls to a tracking server from a thread of their own: a logging point never waits on the network.

A tracker hands its calls (start the run, log a batch of metrics, upload files, end the run) to a
`Background` and returns at once; one daemon thread makes them, in order. What the training
loop can lose to a tracker is bounded:

* a logging point: none (the call is queued; a full queue drops it);
* a server that stops answering: a call that has not returned within `timeout_s` ends the
  tracker's logging; what is queued then, and everything after, is dropped;
* the run's end (`close`): the queue is waited for while its calls keep returning within
  `timeout_s`, so a dead server costs at most `timeout_s` there, and one known to be dead nothing.

Work that is no server's answer (a client's first import, a local store's files) is not timed
(`timed(False)`). The first loss (a stuck call, a failed one, a full queue) is said in one line,
the only one; every
value is in `metrics.jsonl` anyway. The thread is a daemon: a call stuck in a client's retries
(MLflow's back off for minutes) never holds the process's exit, a preemption's among them.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_STOP = object()


class Background:
    """One daemon thread that makes the calls `submit`ted to it, in order (see the module doc).
    `name` starts its one line (`mlflow: ...`); `target` says what does not answer."""

    def __init__(self, name: str, target: str, timeout_s: float = 5.0, capacity: int = 10_000):
        self.name, self.target, self.timeout_s = name, target, float(timeout_s)
        self.dropped = 0  # calls not made: queued after a loss, or past a full queue
        self.said: str | None = None  # the one line, once said
        self._queue: queue.Queue[Any] = queue.Queue(capacity)
        self._busy_since: float | None = None  # when the call being made started
        self._timed, self._limit_s = True, self.timeout_s  # whether calls are timed, and against what
        self._down = False  # from here on nothing is sent
        self._thread = threading.Thread(target=self._run, name=f"hydraspeed-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue `fn(*args, **kwargs)`; never waits."""
        if self._stuck() or self._down:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait((fn, args, kwargs))
        except queue.Full:
            self.dropped += 1
            self._say(f"{self.target} takes the values more slowly than the run logs them; what does not fit")

    def timed(self, on: bool, limit_s: float | None = None) -> None:
        """From the sender's thread: whether the calls made from now on count against a limit,
        `limit_s` (default `timeout_s`; the clock restarts now). Local work is not a server that
        stopped answering (a client's first import, a local store's tables), and a server's first
        answers may take longer than the others."""
        self._timed, self._limit_s = on, self.timeout_s if limit_s is None else float(limit_s)
        if self._busy_since is not None:
            self._busy_since = time.monotonic()

    def close(self) -> None:
        """Wait for the queued calls while they keep returning within `timeout_s` (none when the
        server is known to be down); what is left is dropped."""
        stopping = False
        while self._thread.is_alive() and not self._stuck() and not self._down:
            if not stopping:
                try:
                    self._queue.put_nowait(_STOP)
                    stopping = True
                except queue.Full:  # the thread is still working through it
                    pass
            self._thread.join(0.05)
        self._down = True

    def _stuck(self) -> bool:
        """True once a timed call has taken longer than its limit (said once)."""
        since = self._busy_since
        if not self._down and self._timed and since is not None and time.monotonic() - since > self._limit_s:
            self._down = True
            self._say(
                f"{self.target} has not answered for {self._limit_s:g} s; logging to it stops here and what"
            )
        return self._down

    def _say(self, what: str) -> None:
        if self.said is None:
            self.said = f"{self.name}: {what} cannot be sent is dropped (metrics.jsonl has every value)"
            print(self.said, file=sys.stderr, flush=True)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._down:
                self.dropped += 1
                continue
            fn, args, kwargs = item
            self._busy_since = time.monotonic()
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - never stop training for a tracker
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                self._say(f"logging failed ({type(exc).__name__}{': ' + first[:200] if first else ''}); what")
            finally:
                self._busy_since = None
