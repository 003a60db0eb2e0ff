"""A checkpoint is checked before anything reads it: every file must be the one that was saved
(a SHA-256 per file, recorded in COMPLETE.json), every torch file (`*.pt`, the only files
DeepSpeed's loaders unpickle) must load with `torch.load(weights_only=True)`, so unpickling it
can never run code, and no symbolic link may lead past those checks. DeepSpeed's own loaders
(`load_checkpoint`, `zero_to_fp32`, `ds_to_universal`) unpickle freely; they only ever see
files that passed these checks.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from framework.backend.checkpoint_files import allowed_classes
from framework.errors import CheckpointError

# Files that hold only what is written into COMPLETE.json itself, or are rewritten after it.
_UNHASHED = ("COMPLETE.json",)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def digests(path: Path) -> dict[str, str]:
    """{file path relative to the checkpoint dir: SHA-256} for every file of checkpoint `path`."""
    return {
        str(file.relative_to(path)): sha256(file)
        for file in sorted(_files(path))
        if file.name not in _UNHASHED
    }


def load_safely(file: Path) -> Any:
    """`torch.load` that can never run code from the file (CPU tensors, DeepSpeed's classes allowed)."""
    with torch.serialization.safe_globals(allowed_classes()):
        return torch.load(file, weights_only=True, map_location="cpu")


def _check_loads_without_code(path: Path, file: Path) -> None:
    try:
        with torch.serialization.safe_globals(allowed_classes()):
            torch.load(file, weights_only=True, map_location="cpu", mmap=True)  # mmap: tensors are not read
    except pickle.UnpicklingError as exc:
        needs = (
            str(exc).split("Unsupported global:")[-1].strip().splitlines()[0]
            if "Unsupported global" in str(exc)
            else ""
        )
        what = f" ({needs.strip(' .')})" if needs else ""
        raise CheckpointError(
            f"checkpoint {path}: {file.name} would run code when loaded{what}; refusing to load it. "
            "Only load checkpoints from a source you trust, or export its weights where it was made"
        ) from None
    except Exception as exc:  # noqa: BLE001 - truncated, not a torch file, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} is damaged: {file} cannot be read ({first})") from None


def verify(path: Path, meta: dict[str, Any]) -> None:
    """Raise CheckpointError unless every recorded file is unchanged and every torch file of
    checkpoint `path` loads without running code. Metadata without checksums is refused: every
    save records them, so their absence means COMPLETE.json was rewritten or made elsewhere."""
    recorded = meta.get("files")
    if not isinstance(recorded, dict) or not recorded:
        raise CheckpointError(
            f"checkpoint {path} cannot be verified: its COMPLETE.json records no checksums ('files'), which "
            "every save writes; refusing to load it (use a checkpoint saved by this framework, or save one again)"
        )
    for name, digest in recorded.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing")
        if sha256(file) != digest:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} is not the file that was saved (its checksum differs)"
            )
    for file in sorted(_files(path)):
        if file.name.endswith(".pt"):  # DeepSpeed's loaders unpickle *.pt files only
            _check_loads_without_code(path, file)


def stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when any file of checkpoint `path` changes: each file's name, size and
    modification time (cheap next to hashing)."""
    return tuple((str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in sorted(_files(path)))


def _files(path: Path) -> list[Path]:
    """Every file of checkpoint `path`; a CheckpointError for a symbolic link anywhere in it (a
    link can point at files no check has seen, or change after the check)."""
    if path.is_symlink():  # os.walk follows a link given as its top
        raise CheckpointError(
            f"checkpoint {path} is a symbolic link; refusing to load it (point trainer.resume at the "
            "checkpoint dir itself, or copy it)"
        )
    found = []
    for root, dirs, files in os.walk(path):  # does not follow links into other directories
        for name in dirs + files:
            entry = Path(root) / name
            if entry.is_symlink():
                raise CheckpointError(
                    f"checkpoint {path}: {entry.relative_to(path)} is a symbolic link; refusing to load it "
                    "(copy the files themselves into the checkpoint)"
                )
            if name in files:
                found.append(entry)
    return found
