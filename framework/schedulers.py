"""Learning-rate schedules as factories `schedule(optimizer, total_steps=N)`, stepped once per
optimizer step. The engine fills `total_steps` from the epochs, data and `max_steps`."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def constant(optimizer: Optimizer, total_steps: int = 1, warmup_steps: int = 0) -> LambdaLR:
    """The optimizer's learning rate, after an optional linear warm-up."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return LambdaLR(optimizer, factor)


def warmup_cosine(
    optimizer: Optimizer, total_steps: int = 1, warmup_fraction: float = 0.05, min_lr_ratio: float = 0.1
) -> LambdaLR:
    """Linear warm-up over `warmup_fraction` of the steps, then cosine decay to `min_lr_ratio` x lr."""
    warmup = max(0, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
