"""Classification data: scikit-learn's shipped 8x8 digits, and generated Gaussian clusters."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils.data import TensorDataset

from framework.errors import ConfigError


class Splits(NamedTuple):
    """A training set and a validation set: what a `data.dataset` target returns (two map-style
    datasets or streams, `framework.data.streams`; a `datasets.DatasetDict` with `train` and
    `validation` splits is taken too)."""

    train: Any  # a map-style Dataset, or iterable data
    valid: Any


_VALID_NAMES = ("validation", "valid", "test")


def as_splits(data: Any) -> Splits:
    """`Splits` from what a dataset target returned: `Splits(train, valid)` as it is, or a
    `datasets.DatasetDict`'s `train` and `validation` / `valid` / `test` splits (as tensors)."""
    if isinstance(data, Splits):
        return data
    keys = list(data.keys()) if hasattr(data, "keys") else None
    if keys is not None and "train" in keys:
        valid = next((name for name in _VALID_NAMES if name in keys), None)
        if valid is None:
            raise ConfigError(
                f"data.dataset returned splits {keys}: name one 'validation' (or 'valid' / 'test'), "
                "or return framework.data.datasets.Splits(train, valid)"
            )
        return Splits(_torch_rows(data["train"]), _torch_rows(data[valid]))
    raise ConfigError(
        f"data.dataset returned a {type(data).__name__}: a dataset target returns "
        "framework.data.datasets.Splits(train, valid) or a datasets.DatasetDict with a 'train' split"
    )


def _torch_rows(dataset: Any) -> Any:
    """A `datasets.Dataset` without a format gives tensors (lists would not batch)."""
    if hasattr(dataset, "with_format") and getattr(dataset, "format", {}).get("type") is None:
        return dataset.with_format("torch")
    return dataset


def _split(x: torch.Tensor, y: torch.Tensor, val_fraction: float, seed: int) -> Splits:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(round(len(x) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return Splits(TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val]))


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """scikit-learn's 1,797 handwritten 8x8 digits (shipped with the package), pixels scaled to
    [0, 1], split into train / validation with a fixed seed."""
    table = _shipped_digits()
    x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
    y = torch.tensor(table[:, -1], dtype=torch.long)
    return _split(x, y, val_fraction, split_seed)


def _shipped_digits() -> Any:
    """The digits table (64 pixel columns, then the label) as scikit-learn ships it. Read from the
    package's data file directly: importing scikit-learn (and SciPy with it) costs ~0.8 s of a
    default run's start. Falls back to `load_digits` if the file is not where it used to be."""
    import gzip
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


def synthetic(
    num_samples: int = 2048,
    num_features: int = 64,
    num_classes: int = 10,
    noise: float = 1.0,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Splits:
    """Gaussian clusters around random class centres: learnable, any size, for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, num_features, generator=g) * 2.0
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = centres[y] + noise * torch.randn(num_samples, num_features, generator=g)
    return _split(x, y, val_fraction, seed)
