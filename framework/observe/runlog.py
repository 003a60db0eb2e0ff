"""The console output of a run, also in its run dir's log file (Hydra's `<job name>.log`, which
otherwise holds only Python `logging` records: empty in every run).

`tee(path)` copies what this process writes to stdout and stderr into `path` while it is active.
A live terminal display (rich's progress bars redraw themselves with cursor codes many times a
second) is not copied; plain lines are, without colour codes. Rank 0 only.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_CURSOR = re.compile(r"\x1b\[(\?25[lh]|[0-9]*[ABCDGJK])|\r(?!\n)")


class _Tee:
    """A text stream that writes to `stream` and a copy (see the module doc) to `copy`."""

    def __init__(self, stream: TextIO, copy: TextIO):
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        if not _CURSOR.search(text):
            self._copy.write(_COLOUR.sub("", text))
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        self._copy.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the real stream
        return getattr(self._stream, name)


@contextlib.contextmanager
def tee(path: Path) -> Iterator[None]:
    """Copy stdout and stderr into `path` (appended) while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8", buffering=1) as copy:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, copy), _Tee(err, copy)  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = out, err


def hydra_log_file() -> str | None:
    """The file Hydra's job logging writes to (`<output dir>/<job name>.log`), if it writes one."""
    import logging

    handlers = logging.getLogger().handlers
    return next((h.baseFilename for h in handlers if isinstance(h, logging.FileHandler)), None)
