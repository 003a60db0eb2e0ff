"""One run at a time writes a checkpoints dir: rank 0 holds a flock on `<dir>/.lock` (pid and
host written in it, for the message another run gets)."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from framework.errors import ConfigError
from framework.process.context import ProcessContext

LOCK = ".lock"


def _lock_holder(lock: Path) -> dict[str, Any] | None:
    """Who holds `lock`, or None when nobody (no file, or a process of this host that is gone)."""
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return None  # a run that died without releasing it
        except PermissionError:
            pass
    return holder


_held: dict[str, int] = {}  # lock file -> the open descriptor this process holds its flock on


def _take(lock: Path) -> bool:
    """An exclusive flock on `lock` for this process (the kernel drops it when the process ends,
    however it ends); False when another process holds it. Atomic, unlike reading the file and
    writing it: two runs starting together cannot both win."""
    for _ in range(3):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino  # not a file a releasing run just unlinked
        except FileNotFoundError:
            same = False
        if same:
            _held[str(lock)] = fd
            return True
        os.close(fd)
    return False


def _in_use(ckpt_dir: Path, lock: Path) -> str | None:
    """Take `ckpt_dir`'s lock; what stops this run from taking it, or None once it holds it."""
    here = {"pid": os.getpid(), "host": socket.gethostname()}
    if str(lock) in _held:
        return None
    if not _take(lock):
        return _in_use_message(ckpt_dir, lock, _lock_holder(lock) or {})
    # The file may name a run that holds no flock: one on another host (flock may not reach
    # across hosts) or one started by an older version. A live one still counts, a gone one not.
    previous = _lock_holder(lock)
    if previous is not None and {key: previous.get(key) for key in here} != here:
        os.close(_held.pop(str(lock)))
        return _in_use_message(ckpt_dir, lock, previous)
    fd = _held[str(lock)]
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({**here, "time": time.time()}).encode(), 0)
    atexit.register(release_lock, ckpt_dir)
    return None


def _in_use_message(ckpt_dir: Path, lock: Path, holder: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("time", 0))))
    return (
        f"checkpoint dir {ckpt_dir} is in use by another run (pid {holder.get('pid')} on {holder.get('host')}, "
        f"since {since}); give this run its own trainer.checkpoint.dir, or remove {lock} if that run is gone"
    )


def acquire_lock(ckpt_dir: Path, process: ProcessContext | None = None) -> None:
    """Rank 0 takes `ckpt_dir`'s lock for this run (a flock, with pid + host written in the file
    for the message); another live run holding it is a ConfigError on every rank. Released by
    `release_lock` (and at process exit). `process`: the job's ranks (None: this process alone)."""
    problem, job = None, process if process is not None else ProcessContext("cpu")
    if job.is_main:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            problem = _in_use(ckpt_dir, ckpt_dir / LOCK)
        except OSError as exc:  # read-only, not a dir, no permission
            problem = (
                f"checkpoint dir {ckpt_dir} cannot be written ({exc.strerror or exc}): set "
                "trainer.checkpoint.dir to a writable dir, or trainer.checkpoint.enabled=false"
            )
    problem = job.broadcast_object(problem)
    if problem:
        raise ConfigError(problem)


def release_lock(ckpt_dir: Path) -> None:
    """Give `ckpt_dir`'s lock back if this process holds it."""
    lock = ckpt_dir / LOCK
    fd = _held.pop(str(lock), None)
    if fd is not None:
        lock.unlink(missing_ok=True)
        os.close(fd)
