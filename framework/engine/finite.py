"""A NaN or inf validation result is an error that names its first bad batch, never a silent
`val_loss nan` that a sweep then optimises.

Evaluation keeps each batch's loss as a 0-dim tensor (no device sync per batch); only when the
total is not finite are they read, to name the first batch (on its rank) that made it so.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from framework.errors import NonFiniteLoss
from framework.process.context import ProcessContext


class BatchLosses:
    """The loss of each evaluation batch this rank ran, in order."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def add(self, loss: Any) -> None:
        """Record one batch's loss (a tensor stays on its device until a check needs it)."""
        value = loss.detach().float().sum() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self.values.append(value)

    def first_bad(self) -> int | None:
        """The index (from 0) of the first batch whose loss is NaN or inf, or None."""
        if not self.values:
            return None
        finite = torch.isfinite(torch.stack([v.cpu() for v in self.values]))
        bad = (~finite).nonzero()
        return int(bad[0]) if len(bad) else None


def _not_finite(value: Any) -> bool:
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError):  # a metric that is not a number (a tensor of several values, ...)
        return False


def check_validation(result: dict[str, Any], losses: BatchLosses, process: ProcessContext) -> None:
    """Collective (every rank holds the same `result`): raise NonFiniteLoss when a validation
    value is NaN or inf, naming the first batch and rank whose loss was, and what to check."""
    bad = [name for name, value in result.items() if _not_finite(value)]
    if not bad:
        return
    firsts = process.all_gather_object(losses.first_bad())
    where = next(((rank, index) for rank, index in enumerate(firsts) if index is not None), None)
    shown = ", ".join(f"{name}={float(result[name])}" for name in bad)
    located = (
        f"the first batch with a non-finite loss is validation batch {where[1]} of rank {where[0]}"
        if where is not None
        else "every batch's loss was finite (a metric's value is not)"
    )
    raise NonFiniteLoss(
        f"evaluation on the validation data gave {shown} (val_{bad[0]} in the logs): {located}; check the validation data for NaN/inf inputs or labels "
        "(and the model's outputs on them), then run again"
    )
