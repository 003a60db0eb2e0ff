"""Data from a file of your own: a CSV of numeric features with a label column."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from framework.datasets.classification import Splits, _split


def csv_classification(
    path: str, label_column: str = "label", val_fraction: float = 0.2, split_seed: int = 0
) -> Splits:
    """Rows of a CSV file with a header: every column but `label_column` is a float feature,
    `label_column` holds integer class ids. Split into train / validation with a fixed seed."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.dataset.path={path}: no such file")
    with open(file, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or label_column not in rows[0]:
        raise ValueError(f"{file} has no rows or no '{label_column}' column (set data.dataset.label_column)")
    features = [k for k in rows[0] if k != label_column]
    x = torch.tensor([[float(r[k]) for k in features] for r in rows], dtype=torch.float32)
    y = torch.tensor([int(r[label_column]) for r in rows], dtype=torch.long)
    return _split(x, y, val_fraction, split_seed)
