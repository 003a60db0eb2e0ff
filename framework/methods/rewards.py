"""Reward functions for online methods (GRPO), with TRL's signature:

    def my_reward(prompts, completions, **columns) -> list[float | None]

`prompts` are the rows' prompts as the data gave them (strings, or lists of chat messages);
`completions` are strings for text prompts and `[{"role": "assistant", "content": ...}]` for
chat prompts; the data's other columns come by name, one value per completion (plus
`completion_ids`, the token ids). `None` means "not applicable": that completion is left out of
the function's mean, and a completion no function scores counts for nothing. A function is given
as a callable or by its import path (`my_module.my_reward`, found on PYTHONPATH or in the
working directory). A function that cannot be imported, raises, returns the wrong number of
values or a non-number is one line naming it and, where it applies, the first bad row.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from framework.errors import ConfigError


def _import(path: str) -> Callable[..., Any]:
    if os.getcwd() not in sys.path:  # the working directory, as `python -m` and train.py read it
        sys.path.insert(1, os.getcwd())
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"reward function {path!r}: give its import path, module.function")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"reward function {path}: cannot be imported ({type(exc).__name__}: {exc})"
        ) from None
    if not callable(found):
        raise ConfigError(f"reward function {path}: {type(found).__name__} is not callable")
    return found


class RewardFunction:
    """One reward function, checked where it is called (see the module doc)."""

    def __init__(self, function: Any):
        self.fn = _import(function) if isinstance(function, str) else function
        if not callable(self.fn):
            raise ConfigError(f"reward function {function!r}: not callable, nor an import path")
        self.name = getattr(self.fn, "__name__", type(self.fn).__name__)
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            params = []  # type: ignore[assignment]
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        self.takes = {p.name for p in params}

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, list[Any]]
    ) -> list[float]:
        """One reward per completion (NaN where the function said None)."""
        given = columns if self.takes_all else {k: v for k, v in columns.items() if k in self.takes}
        try:
            values = self.fn(prompts=list(prompts), completions=list(completions), **given)
        except ConfigError:
            raise
        except Exception as exc:  # the user's code: say which function failed, and how
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError(f"reward function {self.name} raised {type(exc).__name__}: {first}") from exc
        if (
            not isinstance(values, Sequence)
            or isinstance(values, (str, bytes))
            or len(values) != len(completions)
        ):
            size = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise ConfigError(
                f"reward function {self.name} returned {size} values for {len(completions)} completions: "
                "give one number (or None) per completion"
            )
        return [self._number(value, i) for i, value in enumerate(values)]

    def _number(self, value: Any, row: int) -> float:
        if value is None:
            return math.nan
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
            raise ConfigError(
                f"reward function {self.name} returned {value!r} for completion {row}: give a number, or None "
                "for 'not applicable'"
            )
        return float(value)


def reward_functions(
    functions: Sequence[Any], weights: Sequence[float] | None
) -> tuple[list[RewardFunction], torch.Tensor]:
    """The checked functions and their weights (default: 1 each)."""
    if not functions:
        raise ConfigError(
            "GRPO(reward_funcs=[]): give at least one reward function (an import path or a callable)"
        )
    loaded = [RewardFunction(f) for f in functions]
    if weights is None:
        return loaded, torch.ones(len(loaded), dtype=torch.float64)
    if len(weights) != len(loaded):
        raise ConfigError(
            f"GRPO(reward_weights={list(weights)}): {len(weights)} weights for {len(loaded)} reward functions"
        )
    return loaded, torch.tensor([float(w) for w in weights], dtype=torch.float64)


def score(
    functions: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: dict[str, list[Any]],
) -> torch.Tensor:
    """Every function's rewards, `[completions, functions]` (float64, NaN for None)."""
    return torch.tensor([f(prompts, completions, columns) for f in functions], dtype=torch.float64).T.reshape(
        len(completions), len(functions)
    )
