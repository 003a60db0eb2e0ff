"""Checks of what a user hands the Python API, made before anything is built or trained: a wrong
argument is a one-line `ConfigError` naming it and what to pass, not an AttributeError inside
`fit` after an epoch has trained."""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any

import torch
from torch import nn

from framework.data.outputs import ModelLoss, is_model_loss
from framework.data.streams import is_stream
from framework.errors import ConfigError


def _kind(value: Any) -> str:
    return f"{value!r}" if isinstance(value, (str, int, float)) else f"a {type(value).__name__}"


def check_engine_arguments(model: Any, loss: Any, optimizer: Any, metrics: Any, scheduler: Any) -> None:
    """Raise a ConfigError for an `Engine(...)` argument that cannot work."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"Engine(model=...) needs a torch.nn.Module, got {_kind(model)}")
    if loss is not None and not is_model_loss(loss) and not callable(loss):
        raise ConfigError(
            f"Engine(loss=...) needs a callable loss(outputs, labels) such as torch.nn.CrossEntropyLoss(), "
            f"or 'model' for the loss the model computes itself; got {_kind(loss)}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise ConfigError(
            f"Engine(optimizer=...) needs a torch optimizer or a factory of one, e.g. "
            f"functools.partial(torch.optim.AdamW, lr=1e-3); got {_kind(optimizer)}"
        )
    if scheduler is not None and not callable(scheduler):
        raise ConfigError(
            f"Engine(scheduler=...) needs a factory scheduler(optimizer[, total_steps]); got {_kind(scheduler)}"
        )
    for name, metric in _metric_items(metrics):
        if not hasattr(metric, "update") or not hasattr(metric, "compute"):
            raise ConfigError(
                f"Engine(metrics=...): metric {name!r} is {_kind(metric)}, not a metric object with update() "
                "and compute() (e.g. framework.observe.metrics.Accuracy() or a torchmetrics metric)"
            )


def _metric_items(metrics: Any) -> Iterable[tuple[str, Any]]:
    if metrics is None:
        return []
    if isinstance(metrics, dict) or hasattr(metrics, "items"):
        return list(metrics.items())
    values = metrics if isinstance(metrics, (list, tuple)) else [metrics]
    return [(str(i), m) for i, m in enumerate(values)]


def check_dataset(data: Any, name: str, optional: bool = False) -> None:
    """Raise a ConfigError when `data` (an argument called `name`) is neither a sized dataset nor
    a stream (`framework.data.streams.is_stream`)."""
    if data is None and optional or is_stream(data):
        return
    if isinstance(data, (str, bytes, int, float, bool)) or data is None or not isinstance(data, Sized):
        hint = (
            "; the training options are keyword arguments: fit(train_data, valid_data, epochs=3, batch_size=64)"
            if isinstance(data, (int, float))
            else ""
        )
        raise ConfigError(
            f"{name} must be a map-style dataset (with len() and indexing) or iterable data (a torch "
            f"IterableDataset, a datasets.IterableDataset, a framework.data.streams.Stream), got {_kind(data)}{hint}"
        )


def options_of(cls: type, options: dict[str, Any], call: str) -> None:
    """Raise a ConfigError for an option `cls` (a dataclass) has no field for."""
    valid = list(getattr(cls, "__dataclass_fields__", {}))
    unknown = [key for key in options if key not in valid]
    if unknown:
        raise ConfigError(f"{call} got unknown option(s) {unknown}; valid: {', '.join(valid)}")


def check_pipeline(strategy: Any, loss: Any, train_step: Any, eval_step: Any) -> None:
    """Under pipeline parallelism: a loss function (the last stage computes it), no custom steps."""
    if not strategy.uses_pipeline:
        return
    if isinstance(loss, ModelLoss):
        raise ConfigError(
            "pipeline parallelism needs a loss function (the last stage computes it), not loss=model"
        )
    if train_step is not None or eval_step is not None:
        raise ConfigError(
            "custom training/validation steps cannot run with pipeline parallelism: "
            "the pipeline engine drives the micro-batches itself"
        )
