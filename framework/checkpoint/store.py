"""Checkpoints on disk: the layout, atomic writes, completeness, finding and pruning.

Layout of a checkpoints dir (`trainer.checkpoint.dir`, default `<output dir>/checkpoints`)::

    step_00000120/                DeepSpeed's own files (every rank writes its shard) plus
        hydraspeed_rank00000.pt   each rank's loop state: counters, RNG, loader position, metrics
        COMPLETE.json             written by rank 0 last, after every rank's files are on disk
    latest                        name of the newest complete checkpoint (moved atomically)
    step_00000120_universal/      the same, converted for another tensor-parallel degree by an
                                  export (pruned with it); a resume on another layout converts
                                  into a cache instead (`universal_cache`), never into this dir

A dir without COMPLETE.json is a save that did not finish; one whose files differ from the
checksums in COMPLETE.json, or would run code when unpickled, is damaged (see `safety`).
`resume=auto` skips both, naming each. One run at a time writes a dir (`.lock`: pid and host).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from framework.backend import checkpoint_files
from framework.checkpoint import safety
from framework.checkpoint.lock import LOCK, acquire_lock, release_lock
from framework.errors import CheckpointError, ConfigError
from framework.process import watchdog
from framework.process.context import ProcessContext

COMPLETE = "COMPLETE.json"
BAD = "BAD.json"  # a complete checkpoint whose weights gave a NaN/inf loss
LATEST = "latest"
TAG = re.compile(r"^step_(\d+)$")
UNIVERSAL = re.compile(r"^(step_\d+)_universal$")  # a checkpoint converted for another world size
CONVERTING = ".converting-"  # a conversion in progress: <name>_universal.converting-<pid>-<random>
RANK_FILE = "hydraspeed_rank{rank:05d}.pt"
__all__ = ["LOCK", "acquire_lock", "release_lock"]  # re-exported: one run per dir (`lock`)


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
    _verified[str(path)] = safety.stamp(path)  # hashed just now: nothing to re-check
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
            _remove(p)
    for p in ckpt_dir.iterdir():  # a conversion goes with the checkpoint it was made from
        source = UNIVERSAL.match(p.name)
        if source and not (ckpt_dir / source.group(1)).exists():
            _remove(p)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_interrupted(ckpt_dir: Path) -> None:
    """Remove what a conversion that was killed left (`<name>_universal.converting-<pid>-*`, up to
    twice the checkpoint's size), unless its process still runs on this host."""
    for p in ckpt_dir.glob(f"*{CONVERTING}*"):
        pid = p.name.split(CONVERTING, 1)[1].split("-", 1)[0]
        if not (pid.isdigit() and _alive(int(pid))):
            _remove(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# ---------------------------------------------------------------------------- finding


def ranks(process: ProcessContext | None) -> ProcessContext:
    """The job's ranks that must agree (`process`), or this process alone."""
    return process if process is not None else ProcessContext("cpu")


def _say(text: str) -> None:
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


def find_resumable(ckpt_dir: str | Path, process: ProcessContext | None = None) -> Path | None:
    """The newest complete, intact checkpoint in `ckpt_dir` (rank 0 of `process` looks, every rank
    gets the answer); newer partial or damaged ones are skipped, each named once with why."""
    ckpt_dir, job = Path(ckpt_dir), ranks(process)
    with watchdog.suspended(watchdog.LONG_WORK, "verifying checkpoints"):  # hashing may take long
        found = _newest_intact(ckpt_dir) if job.is_main and ckpt_dir.is_dir() else None
        found = job.broadcast_object(str(found) if found else None, slow=True)
    return Path(found) if found else None


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's COMPLETE.json, or a CheckpointError saying what is wrong with it."""
    marker = path / COMPLETE
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {marker} is missing (the save did not finish)"
        )
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {marker} cannot be read ({exc})") from None
    missing = [key for key in REQUIRED if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {marker} lacks {', '.join(missing)} (every save writes them)"
        )
    return dict(meta)


# What every save writes in COMPLETE.json (its `files` checksums are checked by `safety.verify`).
REQUIRED = ("step", "world_size", "dp_size", "micro_batch_size", "zero_stage")


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


def check(path: Path, process: ProcessContext | None = None) -> dict[str, Any]:
    """The checkpoint's metadata after rank 0 of `process` verified it (every rank gets the
    error, if any)."""
    problem, job = None, ranks(process)
    with watchdog.suspended(watchdog.LONG_WORK, "verifying a checkpoint"):
        if job.is_main:
            try:
                verify(path)
            except CheckpointError as exc:
                problem = str(exc)
        problem = job.broadcast_object(problem, slow=True)
    if problem:
        raise CheckpointError(problem)
    return read_meta(path)


def resolve(
    resume: str | Path, ckpt_dir: str | Path | None, process: ProcessContext | None = None, name: str = ""
) -> Path | None:
    """`auto` -> the newest intact checkpoint in `ckpt_dir` (None if there is none, said in one
    line); a path -> that checkpoint (verified), or the newest intact one in that dir. Every rank
    of `process` gets the same answer. `name`: what the user gave it as, for the messages
    (default `trainer.resume=<resume>`)."""
    name = name or f"trainer.resume={resume}"
    if str(resume) == "auto":
        found = find_resumable(ckpt_dir, process) if ckpt_dir is not None else None
        if found is None and ranks(process).is_main:
            _say(f"resume=auto: no complete checkpoint in {ckpt_dir} yet; starting from the beginning")
        return found
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"{name}: no such checkpoint")
    if TAG.match(path.name) or (path / COMPLETE).exists():
        check(path, process)
        return path
    found = find_resumable(path, process)
    if found is None:
        raise ConfigError(f"{name}: no complete checkpoint in that dir")
    return found


def mark_bad(paths: list[str], reason: str, process: ProcessContext | None = None) -> None:
    """Rank 0 of `process`: note in each checkpoint why `resume=auto` must not pick it."""
    if ranks(process).is_main:
        for path in paths:
            if Path(path).is_dir():
                atomic_write(Path(path) / BAD, json.dumps({"reason": reason}))


# ---------------------------------------------------------------------------- another world size


def universal_cache(path: Path) -> Path:
    """Where a resume's conversion of checkpoint `path` goes: a cache the run that saved it never
    sees (`$HYDRASPEED_CACHE`, else `$XDG_CACHE_HOME/hydraspeed`, else `~/.cache/hydraspeed`; on
    several nodes, a dir every node sees), one dir per checkpoint (by its COMPLETE.json)."""
    root = os.environ.get("HYDRASPEED_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "hydraspeed"
    )
    return Path(root) / "universal" / safety.sha256(path / COMPLETE)[:16]


def to_universal(path: Path, process: ProcessContext | None = None, into: Path | None = None) -> Path:
    """Convert a ZeRO checkpoint to DeepSpeed's universal format (once; rank 0 of `process`
    converts) as `<into>/<name>_universal` (`into`: beside `path` by default). Collective: the
    other ranks wait for the conversion."""
    out, job = (into or path.parent) / (path.name + "_universal"), ranks(process)
    if job.is_main:
        meta = verify(path)
        source = safety.sha256(path / COMPLETE)
        try:  # a dir of that name that is not this checkpoint's conversion is converted over
            done = read_meta(out).get("converted_from") == source
        except CheckpointError:
            done = False
        if not done:
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert(path, out, dict(meta, converted_from=source))
    job.barrier(slow=True)
    return out


def drop_conversion(out: Path, process: ProcessContext | None = None) -> None:
    """Collective, once every rank has loaded conversion `out` (from `universal_cache`): rank 0
    removes it (a new checkpoint of this layout replaces it; another resume converts again)."""
    job = ranks(process)
    job.barrier(slow=True)
    if job.is_main:
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.suppress(OSError):
            out.parent.rmdir()  # its checkpoint's dir in the cache, when empty


def _convert(path: Path, out: Path, meta: dict[str, Any]) -> None:
    """Run DeepSpeed's ds_to_universal on `path` into a new, empty dir (the converter unpickles
    files it finds in its output dir: only its own may be there), then put it in place as `out`."""
    remove_interrupted(out.parent)
    work = Path(tempfile.mkdtemp(prefix=f"{out.name}{CONVERTING}{os.getpid()}-", dir=out.parent))
    fresh = work / out.name  # the converter's `latest_universal` lands in `work`, removed with it
    fresh.mkdir()  # made as any dir the user makes (mkdtemp's are 0700)
    staged = work.with_name(work.name + "-staged")  # SGD's states under Adam's names, when needed
    try:
        renamed = checkpoint_files.adam_shaped(path, staged)
        cmd = checkpoint_files.universal_command(staged if renamed else path, fresh, int(meta["zero_stage"]))
        with watchdog.suspended(watchdog.LONG_WORK, "converting a checkpoint"):
            limit = watchdog.budget()  # stopped (SIGSTOP) or stuck, it is killed before the watchdog fires
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired:
                raise CheckpointError(
                    f"converting {path} for another world size took more than {limit:.0f} s "
                    f"({watchdog.LONG_WORK} x trainer.timeout_s, less the wait so far): DeepSpeed's "
                    "ds_to_universal was stopped or is stuck; it was ended (raise trainer.timeout_s for a "
                    "very large checkpoint)"
                ) from None
        if result.returncode != 0:
            lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
            raise CheckpointError(
                f"could not convert {path} for another world size (DeepSpeed's ds_to_universal failed: "
                f"{lines[-1] if lines else f'exit code {result.returncode}'})"
            )
        for file in path.glob(RANK_FILE.format(rank=0).replace("00000", "*")):
            shutil.copy(file, fresh / file.name)
        if renamed:
            atomic_write(fresh / checkpoint_files.STATE_NAMES, json.dumps(renamed))
        atomic_write(fresh / COMPLETE, json.dumps(dict(meta, files=safety.digests(fresh))))
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.exists():
            shutil.rmtree(out)
        fresh.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staged, ignore_errors=True)
