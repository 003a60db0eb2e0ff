"""Outputs written whole or not at all, as checkpoints are: an export's files go into a temporary
dir beside the target, which becomes the target only once every file is complete.

    with staged_dir(Path("merged")) as tmp:
        model.save_pretrained(tmp)          # a full disk or a file-size limit here: the temporary
                                            # dir is removed, the target is untouched, and the
                                            # error names the target in one line

A new target is the temporary dir renamed; an existing dir keeps its other files and gets the new
ones, each renamed into it (a rename needs no space, so none of them is ever half-written). The
files are readable as any other file the user writes (the umask's mode, not a temporary file's 0600).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

STAGING = ".staging-"  # <target name>.staging-<random>: an export in progress


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _reason(exc: BaseException) -> str:
    """What went wrong, in words: an OSError's text, or the one inside safetensors' I/O error."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    found = re.search(r'I/O error: (.+?) \(os error \d+\)|message: "([^"]+)"', str(exc))
    return (found.group(1) or found.group(2)) if found else str(exc).strip().splitlines()[0]


def _writing_failed(exc: BaseException) -> bool:
    """An error of the file system (a full disk, a file-size limit), raised as such or by safetensors."""
    return isinstance(exc, OSError) or (
        type(exc).__name__ == "SafetensorError" and any(s in str(exc) for s in ("I/O error", "IoError"))
    )


def _publish(staged: Path, target: Path) -> None:
    """The staged files as `target`'s, readable as the umask says."""
    mask = _umask()
    for root, dirs, files in os.walk(staged):
        for name in files:
            os.chmod(Path(root) / name, 0o666 & ~mask)
        for name in dirs:
            os.chmod(Path(root) / name, 0o777 & ~mask)
    os.chmod(staged, 0o777 & ~mask)
    if not target.exists():
        staged.rename(target)
        return
    for entry in sorted(staged.iterdir()):
        destination = target / entry.name
        if destination.is_dir() and not destination.is_symlink():
            shutil.rmtree(destination)
        os.replace(entry, destination)


@contextlib.contextmanager
def _failing_as(target: Path) -> Iterator[None]:
    """A file-system error in the block as an OSError naming `target` with what went wrong."""
    try:
        yield
    except (FileExistsError, NotADirectoryError):  # a file on the path: the caller names it
        raise
    except Exception as exc:
        if not _writing_failed(exc):
            raise
        raise OSError(
            getattr(exc, "errno", None), f"{_reason(exc)}; nothing was written", str(target)
        ) from None


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A temporary dir beside `target` to write into (see the module doc). A file-system error in
    the block becomes an OSError naming `target` with what went wrong; nothing is left behind."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(20, "a file is in the way", str(target))
    with _failing_as(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING}", dir=target.parent))
        try:
            yield staged
            _publish(staged, target)
        finally:
            shutil.rmtree(staged, ignore_errors=True)


@contextlib.contextmanager
def staged_file(target: Path) -> Iterator[Path]:
    """A temporary file beside `target` (with its suffix) to write; it replaces `target` when the
    block ends without an error, and is removed when it does not (the error names `target`)."""
    target = Path(target)
    with _failing_as(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(
            prefix=f".{target.name}{STAGING}", suffix=target.suffix, dir=target.parent
        )
        os.close(fd)
        try:
            yield Path(name)
            os.chmod(name, 0o666 & ~_umask())
            os.replace(name, target)
        finally:
            Path(name).unlink(missing_ok=True)
