"""A character-level corpus from text that ships with Python itself: the standard library's
own source files. Real text, no download, a deterministic train/validation split."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from framework.data.datasets.classification import Splits

VOCAB_SIZE = 128  # 7-bit ASCII; any other character becomes "?"


def stdlib_text(max_chars: int) -> str:
    """The first `max_chars` characters of the standard library's top-level .py files, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library was not found at {root}")
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    """Characters -> ids in [0, 128)."""
    data = text.encode("ascii", errors="replace")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    """Ids -> characters."""
    return bytes(ids.tolist()).decode("ascii", errors="replace")


class CharChunks(Dataset):
    """Non-overlapping windows: item i is (ids[i*T : i*T+T], ids[i*T+1 : i*T+T+1])."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.ids, self.block_size = ids, block_size
        self.count = (len(ids) - 1) // block_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def chars(block_size: int = 64, max_chars: int = 1_000_000, val_fraction: float = 0.1) -> Splits:
    """The stdlib corpus as (input, next-character) windows: the first 1 - val_fraction of the
    text trains, the rest validates."""
    ids = encode(stdlib_text(max_chars))
    cut = int(len(ids) * (1 - val_fraction))
    return Splits(CharChunks(ids[:cut], block_size), CharChunks(ids[cut:], block_size))
