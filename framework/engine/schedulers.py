"""Learning-rate schedules as factories `schedule(optimizer, total_steps=N)`, stepped once per
optimizer step. The engine fills `total_steps` from the epochs, data and `max_steps`.

Warm-up is linear from lr / warmup to lr, over `warmup_steps` optimizer steps (absolute, as in
Hugging Face's schedules) or over `warmup_fraction` of the run when no step count is given."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from framework.errors import ConfigError


def constant(optimizer: Optimizer, total_steps: int = 1, warmup_steps: int = 0) -> LambdaLR:
    """The optimizer's learning rate, after an optional linear warm-up."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return LambdaLR(optimizer, factor)


def warmup_cosine(
    optimizer: Optimizer,
    total_steps: int = 1,
    warmup_fraction: float = 0.05,
    min_lr_ratio: float = 0.1,
    warmup_steps: int | None = None,
) -> LambdaLR:
    """Linear warm-up over `warmup_steps` optimizer steps (when given) or `warmup_fraction` of the
    steps, then cosine decay to `min_lr_ratio` x lr at `total_steps`."""
    warmup = warmup_length(total_steps, warmup_fraction, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def warmup_length(total_steps: int, warmup_fraction: float, warmup_steps: int | None) -> int:
    """Warm-up steps: `warmup_steps` when given, else `warmup_fraction` of `total_steps`."""
    if warmup_steps is not None:
        if int(warmup_steps) < 0:
            raise ConfigError(f"scheduler.warmup_steps={warmup_steps}: must be >= 0")
        return int(warmup_steps)
    if not 0.0 <= warmup_fraction < 1.0:
        raise ConfigError(f"scheduler.warmup_fraction={warmup_fraction}: must be in [0, 1)")
    return max(0, int(total_steps * warmup_fraction))
