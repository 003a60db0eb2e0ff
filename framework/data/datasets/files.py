"""Data from a file of your own: a CSV of numeric features with a label column."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import torch

from framework.data.datasets.classification import Splits, _split
from framework.errors import ConfigError


def _parse(file: Path, label_column: str) -> tuple[list[list[float]], list[int]]:
    """Features and labels of every row, or a ConfigError naming the file, row and column."""
    with open(file, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or label_column not in header:
            raise ConfigError(
                f"{file} has no header row with a '{label_column}' column (set data.dataset.label_column)"
            )
        label_at = header.index(label_column)
        features, labels = [], []
        for row in reader:
            line = reader.line_num
            if not row:
                continue
            if len(row) != len(header):
                raise ConfigError(
                    f"{file}, row {line}: {len(row)} fields where the header has {len(header)}; "
                    "every row needs one value per column"
                )
            values = []
            for column, cell in zip(header, row):
                try:
                    values.append(int(cell) if column == label_column else float(cell))
                except ValueError:
                    kind = "an integer class id" if column == label_column else "a number"
                    raise ConfigError(
                        f"{file}, row {line}, column '{column}': {cell!r} is not {kind}"
                    ) from None
                if not math.isfinite(values[-1]):  # float() reads "nan" and "inf" without complaint
                    raise ConfigError(
                        f"{file}, row {line}, column '{column}': {cell!r} is not a finite number; "
                        "fill or drop that row (a NaN or inf input makes every loss and metric NaN)"
                    )
            labels.append(int(values.pop(label_at)))
            features.append(values)
    if not labels:
        raise ConfigError(f"{file} has a header but no rows")
    return features, labels


def csv_classification(
    path: str, label_column: str = "label", val_fraction: float = 0.2, split_seed: int = 0
) -> Splits:
    """Rows of a CSV file with a header: every column but `label_column` is a float feature,
    `label_column` holds integer class ids. Split into train / validation with a fixed seed."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.dataset.path={path}: no such file")
    features, labels = _parse(file, label_column)
    x = torch.tensor(features, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.long)
    return _split(x, y, val_fraction, split_seed)
