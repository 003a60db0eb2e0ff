"""Step flavours, the default steps, and what a step's result means.

* batch step      ``step(engine, batch)``: the default (`loss(model(*inputs), labels)`), or a
                  model's ``training_step(batch)`` / ``validation_step`` / ``predict_step``.
* iterator step   any step with a parameter named ``dataloader_iter``: it pulls 0, 1 or many
                  batches per call from a `framework.data.BatchIterator`, which counts every
                  fetch (progress, logs, exact resume) and hands out batches already on the
                  device, prefetched in the background.

A training step returns a loss tensor (the framework does backward + optimizer step), a dict
of metrics (the step drove `engine.backward` / `engine.step` itself), or None (nothing to log).
Steps get the `Engine` as their first argument; this module only relies on what a step may use
of it (`model`, `loss`, `metrics`, `backward_and_step`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from framework.data import split_batch
from framework.errors import ConfigError

ITERATOR_ARG = "dataloader_iter"


def takes_iterator(fn: Callable[..., Any]) -> bool:
    """True when `fn` is an iterator-consuming step (has a `dataloader_iter` parameter)."""
    try:
        return ITERATOR_ARG in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def bind_step(step_fn: Callable[..., Any]) -> Callable[[Any, Iterator[Any]], Any]:
    """`step_fn` as one call on an iterator of batches, its flavour decided once: an iterator
    step gets the iterator, a batch step the iterator's next batch."""
    if takes_iterator(step_fn):
        return step_fn
    return lambda engine, batches: step_fn(engine, next(batches))


def resolve_step(
    user_step: Callable[..., Any] | None, module: torch.nn.Module, method: str
) -> Callable | None:
    """The step to use: an explicit one, else the model's `method` (training_step,
    validation_step, predict_step), else None (the framework's default step). A model method
    gets the engine as first argument like a free function does, so both are called as
    `step(engine, batch_or_iter)`."""
    if user_step is not None:
        return user_step
    bound = getattr(module, method, None)
    if not callable(bound):
        return None
    params = inspect.signature(bound).parameters
    if ITERATOR_ARG in params:
        return lambda engine, dataloader_iter: bound(dataloader_iter)
    if next(iter(params), None) == "engine":
        return bound
    return lambda engine, batch: bound(batch)


class LossFunction:
    """The configured loss, computed in float32 whatever the model's compute dtype."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn

    def __call__(self, outputs: Any, labels: Any) -> torch.Tensor:
        if isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
            outputs = outputs.float()
        if isinstance(labels, torch.Tensor) and labels.is_floating_point():
            labels = labels.float()
        return self.fn(outputs, labels)


def default_train_step(engine: Any, batch: Any) -> torch.Tensor:
    """loss(model(*inputs), labels), updating the training metrics."""
    inputs, labels = split_batch(batch)
    outputs = engine.model(*inputs)
    loss = engine.loss(outputs, labels)
    engine.metrics.train.update(outputs, labels)
    return loss


def default_eval_step(engine: Any, batch: Any, unpadded: int) -> tuple[Any, torch.Tensor | None]:
    """Forward one evaluation batch; the loss (a tensor, averaged over the unpadded samples)
    and the evaluation metrics over its first `unpadded` samples."""
    inputs, labels = split_batch(batch)
    outputs = engine.model(*inputs)
    if unpadded == 0 or labels is None or engine.loss is None:
        return outputs, None
    outputs, labels = outputs[:unpadded], labels[:unpadded]
    engine.metrics.eval.update(outputs, labels)
    return outputs, engine.loss(outputs, labels)


def default_predict_step(engine: Any, batch: Any) -> Any:
    """model(*inputs)."""
    inputs, _ = split_batch(batch)
    return engine.model(*inputs)


def apply_train_result(engine: Any, result: Any) -> Any:
    """Act on what a training step returned and give back its loss, still on the device: a loss
    tensor is backpropagated and stepped; a dict (the step optimised itself) is only read; a
    float is a loss the pipeline engine already stepped on."""
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise ConfigError(
                f"the loss must be a scalar, got a tensor of shape {tuple(result.shape)}: reduce it "
                "(e.g. reduction='mean' in the loss, or .mean() in your step)"
            )
        engine.backward_and_step(result)
        return result.detach()
    if isinstance(result, dict):
        loss = result.get("loss")
        return loss.detach() if isinstance(loss, torch.Tensor) else loss
    if result is None or isinstance(result, float):
        return result
    raise TypeError(f"a training step must return a loss tensor, a dict or None, got {type(result).__name__}")
