"""Checkpoints on disk: the layout, atomic writes, completeness, finding and pruning.

Layout of a checkpoints dir (`trainer.checkpoint.dir`, default `<output dir>/checkpoints`)::

    step_00000120/                DeepSpeed's own files (every rank writes its shard) plus
        hydraspeed_rank00000.pt   each rank's loop state: counters, RNG, loader position, metrics
        COMPLETE.json             written by rank 0 last, after every rank's files are on disk
    latest                        name of the newest complete checkpoint (moved atomically)

A dir without COMPLETE.json is a save that did not finish; one whose files differ from the
checksums in COMPLETE.json, or would run code when unpickled, is damaged (see `safety`).
`resume=auto` skips both, naming each. One run at a time writes a dir (`.lock`: pid and host).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from framework import device as dev
from framework import watchdog
from framework.checkpoint import safety
from framework.errors import CheckpointError, ConfigError

COMPLETE = "COMPLETE.json"
BAD = "BAD.json"  # a complete checkpoint whose weights gave a NaN/inf loss
LATEST = "latest"
TAG = re.compile(r"^step_(\d+)$")
RANK_FILE = "hydraspeed_rank{rank:05d}.pt"


def tag_for(step: int) -> str:
    """The dir name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    """The step a checkpoint dir was taken at (-1 for another name)."""
    match = TAG.match(path.name)
    return int(match.group(1)) if match else -1


def rank_file(path: Path, rank: int) -> Path:
    """The loop-state file of `rank` in checkpoint `path`."""
    return path / RANK_FILE.format(rank=rank)


# ---------------------------------------------------------------------------- writing


def fsync_file(path: Path) -> None:
    """Flush a written file to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a dir's entries (new names, renames) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def mark_complete(path: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank's files are written: flush them, record their checksums in
    COMPLETE.json (written last), move `latest`."""
    for file in path.rglob("*"):
        if file.is_file():
            fsync_file(file)
    meta = dict(meta, files=safety.digests(path))
    atomic_write(path / COMPLETE, json.dumps(meta, indent=2))
    _verified[str(path)] = (path / COMPLETE).stat().st_mtime  # written just now: nothing to re-check
    atomic_write(path.parent / LATEST, path.name)


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if TAG.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=step_of)


def prune(ckpt_dir: Path, keep_last_k: int) -> None:
    """Delete all but the newest `keep_last_k` complete checkpoints (and partial ones older than them)."""
    complete = complete_checkpoints(ckpt_dir)
    keep = {p.name for p in complete[-keep_last_k:]}
    oldest_kept = step_of(complete[-keep_last_k]) if len(complete) >= keep_last_k else 0
    for p in ckpt_dir.iterdir():
        if TAG.match(p.name) and p.name not in keep and step_of(p) < oldest_kept:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------- finding


def _say(text: str) -> None:
    if dev.is_main_process():
        print(text, file=sys.stderr, flush=True)


def _newest_intact(ckpt_dir: Path) -> Path | None:
    """Rank 0's scan: the newest checkpoint that is complete and passes `safety.verify`; each one
    skipped on the way is named once, with why."""
    for path in sorted((p for p in ckpt_dir.iterdir() if TAG.match(p.name)), key=lambda p: -step_of(p)):
        if not (path / COMPLETE).is_file():
            _say(f"warning: skipping partial checkpoint {path} (its save did not finish)")
            continue
        if (path / BAD).is_file():
            _say(f"warning: skipping checkpoint {path}: {json.loads((path / BAD).read_text()).get('reason')}")
            continue
        try:
            verify(path)
        except CheckpointError as exc:
            _say(f"warning: skipping {exc}")
            continue
        return path
    return None


def find_resumable(ckpt_dir: str | Path) -> Path | None:
    """The newest complete, intact checkpoint in `ckpt_dir` (rank 0 looks, every rank gets the
    answer); newer partial or damaged ones are skipped, each named once with why."""
    ckpt_dir = Path(ckpt_dir)
    found = _newest_intact(ckpt_dir) if dev.is_main_process() and ckpt_dir.is_dir() else None
    found = dev.broadcast_object(str(found) if found else None, slow=True)
    return Path(found) if found else None


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's COMPLETE.json, or a CheckpointError saying what is wrong with it."""
    marker = path / COMPLETE
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {marker} is missing (the save did not finish)"
        )
    try:
        return dict(json.loads(marker.read_text()))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {marker} cannot be read ({exc})") from None


_verified: dict[str, Any] = {}  # checkpoint path -> its files' names, sizes and mtimes when verified


def verify(path: Path) -> dict[str, Any]:
    """Check a checkpoint before anything reads it (see `safety`); returns its metadata. A
    checkpoint verified once in this process is not hashed again while none of its files changed
    (name, size and modification time of each)."""
    meta = read_meta(path)
    stamp = safety.stamp(path)
    if _verified.get(str(path)) != stamp:
        safety.verify(path, meta)
        _verified[str(path)] = stamp
    return meta


def check(path: Path) -> dict[str, Any]:
    """The checkpoint's metadata after rank 0 verified it (every rank gets the error, if any)."""
    problem = None
    if dev.is_main_process():
        try:
            verify(path)
        except CheckpointError as exc:
            problem = str(exc)
    problem = dev.broadcast_object(problem, slow=True)
    if problem:
        raise CheckpointError(problem)
    return read_meta(path)


def resolve(resume: str | Path, ckpt_dir: str | Path | None) -> Path | None:
    """`auto` -> the newest intact checkpoint in `ckpt_dir` (None if there is none, said in one
    line); a path -> that checkpoint (verified), or the newest intact one in that dir."""
    if str(resume) == "auto":
        found = find_resumable(ckpt_dir) if ckpt_dir is not None else None
        if found is None:
            _say(f"resume=auto: no complete checkpoint in {ckpt_dir} yet; starting from the beginning")
        return found
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"trainer.resume={resume}: no such checkpoint")
    if TAG.match(path.name) or (path / COMPLETE).exists():
        check(path)
        return path
    found = find_resumable(path)
    if found is None:
        raise ConfigError(f"trainer.resume={resume}: no complete checkpoint in that dir")
    return found


def mark_bad(paths: list[str], reason: str) -> None:
    """Rank 0: note in each checkpoint why `resume=auto` must not pick it."""
    if dev.is_main_process():
        for path in paths:
            if Path(path).is_dir():
                atomic_write(Path(path) / BAD, json.dumps({"reason": reason}))


# ---------------------------------------------------------------------------- one run per dir


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


def acquire_lock(ckpt_dir: Path) -> None:
    """Rank 0 takes `ckpt_dir`'s lock for this run (a flock, with pid + host written in the file
    for the message); another live run holding it is a ConfigError on every rank. Released by
    `release_lock` (and at process exit)."""
    problem = None
    if dev.is_main_process():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        problem = _in_use(ckpt_dir, ckpt_dir / LOCK)
    problem = dev.broadcast_object(problem)
    if problem:
        raise ConfigError(problem)


def release_lock(ckpt_dir: Path) -> None:
    """Give `ckpt_dir`'s lock back if this process holds it."""
    lock = ckpt_dir / LOCK
    fd = _held.pop(str(lock), None)
    if fd is not None:
        lock.unlink(missing_ok=True)
        os.close(fd)


# ---------------------------------------------------------------------------- another world size


def to_universal(path: Path) -> Path:
    """Convert a ZeRO checkpoint to DeepSpeed's universal format (once; rank 0 converts).
    Collective: the other ranks wait for the conversion."""
    out = path.with_name(path.name + "_universal")
    if dev.is_main_process():
        meta = verify(path)
        source = safety.sha256(path / COMPLETE)
        try:  # a dir of that name that is not this checkpoint's conversion is converted over
            done = read_meta(out).get("converted_from") == source
        except CheckpointError:
            done = False
        if not done:
            _convert(path, out, dict(meta, converted_from=source))
    dev.barrier(slow=True)
    return out


def _convert(path: Path, out: Path, meta: dict[str, Any]) -> None:
    """Run DeepSpeed's ds_to_universal on `path` into a new, empty dir (the converter unpickles
    files it finds in its output dir: only its own may be there), then put it in place as `out`."""
    fresh = Path(tempfile.mkdtemp(prefix=out.name + ".converting-", dir=out.parent))
    try:
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path)]
        cmd += ["--output_folder", str(fresh)]
        if int(meta["zero_stage"]) == 2:
            cmd.append("--inject_missing_state")
        with watchdog.suspended():
            result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise CheckpointError(
                f"could not convert {path} for another world size (DeepSpeed's ds_to_universal failed):\n"
                + result.stderr[-2000:]
            )
        for file in path.glob(RANK_FILE.format(rank=0).replace("00000", "*")):
            shutil.copy(file, fresh / file.name)
        atomic_write(fresh / COMPLETE, json.dumps(dict(meta, files=safety.digests(fresh))))
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.exists():
            shutil.rmtree(out)
        fresh.rename(out)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
