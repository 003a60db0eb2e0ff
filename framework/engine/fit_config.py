"""`FitConfig`: how `Engine.fit` trains, the one home of its options and their defaults (the CLI
fills it from `trainer.*`, `Engine.fit` from its keyword arguments)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from framework.engine.arguments import options_of


@dataclass
class FitConfig:
    """How `fit` trains: `Engine.fit`'s keyword arguments (the CLI fills them from `trainer.*`).

    `batch_size` is global; `steps_per_epoch` caps optimizer steps per epoch; `log_freq` is in
    optimizer steps; with `save_dir`, a checkpoint every `save_freq` optimizer steps (0: only at
    the end), the newest `keep_last_k` kept; `resume` ("auto" or a path) continues one;
    `handle_preemption` saves and stops at the next step boundary after SIGTERM; with `timeout_s`,
    a rank that makes no progress for that long says so, with its threads' stacks, and exits 1
    (instead of waiting in a collective for torch's 30-minute default)."""

    epochs: int = 1
    batch_size: int = 1
    steps_per_epoch: int | None = None
    valid_freq: int = 1
    log_freq: int = 10
    max_steps: int | None = None
    valid_batch_size: int | None = None
    shuffle: bool = True
    collate_fn: Callable | None = None
    num_workers: int = 0
    valid_at_start: bool = False
    save_dir: str | None = None
    save_freq: int = 0
    keep_last_k: int | None = 3
    resume: str | None = None
    handle_preemption: bool = False
    peak_tflops: float | None = None  # the device's peak for MFU (default: table / measured)
    timeout_s: float | None = None  # a rank without progress this long ends the job (watchdog)
    progress: bool = (
        True  # rank 0 prints progress as the CLI does, unless a ConsoleLogger is among the callbacks
    )

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments (shallow: collate_fn stays the same object)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fit_config(config: FitConfig | None, options: dict[str, Any]) -> FitConfig:
    """`config` (or the defaults) with `options` replacing its fields; an unknown option is a
    ConfigError listing the valid ones."""
    options_of(FitConfig, options, "fit()")
    return replace(config or FitConfig(), **options)
