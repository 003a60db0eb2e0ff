"""Evaluation and prediction behind `Engine.evaluate` / `predict`, and the protocol the loops use.

Like the training loop (`framework.engine.loops`), they work against the small `Host` protocol and
never import the Engine. Every sample is counted once across ranks: evaluation shards are
padded to equal length and the padding never reaches a loss, a metric or an output.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from framework.backend.runtime import Runtime
from framework.data import loaders as data_lib
from framework.data.device_loader import DeviceLoader
from framework.data.outputs import batch_size_of, concat, interleave, map_tensors, split_samples, take
from framework.engine import finite
from framework.engine.steps import (
    bind_step,
    default_eval_step,
    default_predict_step,
    owner,
)
from framework.errors import ConfigError
from framework.observe.callbacks import CallbackList
from framework.observe.metrics import Metrics
from framework.observe.state import LoopState
from framework.process import watchdog
from framework.process.context import ProcessContext


class Host(Protocol):
    """What the loops use of the object that runs them (the Engine)."""

    runtime: Runtime
    module: torch.nn.Module
    state: LoopState
    metrics: Metrics
    callbacks: CallbackList
    seed: int
    prefetch: int
    total_steps: int | None
    scheduler_spec: Callable[..., Any] | None
    loss: Any
    label_key: str
    output_key: str | None
    train_step_fn: Callable[..., Any] | None
    eval_step_fn: Callable[..., Any] | None
    predict_step_fn: Callable[..., Any] | None

    def prepare(self, mode: str | None = None, batch_size: int | None = None) -> None: ...

    def schedule(self, total_steps: int | None) -> None: ...

    def dataloader(
        self,
        dataset: Any,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        mode: str = "train",
    ) -> DeviceLoader: ...

    def save(self, path: str, training: bool = True) -> str: ...


@contextlib.contextmanager
def eval_mode(runtime: Runtime) -> Iterator[None]:
    """The model in evaluation mode for the block, put back as it was however the block ends."""
    was_training = runtime.training
    runtime.train(False)
    try:
        yield
    finally:
        runtime.train(was_training)


def _in_eval_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(host: Host, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), eval_mode(host.runtime):
            return fn(host, *args, **kwargs)

    return wrapper


@_in_eval_mode
def evaluate(
    host: Host, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> dict[str, Any]:
    """Loss and metrics over `data`, every sample counted once across all ranks."""
    runtime = host.runtime
    if runtime.strategy.uses_pipeline:
        return _evaluate_pipeline(host, data, batch_size, steps, collate_fn)
    loader = host.dataloader(
        data, batch_size=batch_size, collate_fn=collate_fn, steps_per_epoch=steps, mode="eval"
    )
    loss_sum: Any = 0.0
    count = 0
    losses = finite.BatchLosses()  # a NaN/inf total names its first batch
    if host.eval_step_fn is not None:  # a custom validation step: average what it returns
        batches, call = data_lib.BatchIterator(iter(loader)), bind_step(host.eval_step_fn)
        while not batches.exhausted():
            try:
                result = call(host, batches)
            except StopIteration:
                break
            watchdog.beat()
            value = result.get("loss") if isinstance(result, dict) else result
            if value is not None:
                loss_sum, count = loss_sum + detached(value), count + 1
                losses.add(value)
    else:
        for batch in loader:
            watchdog.beat()
            unpadded = _unpadded(loader, batch)
            _, batch_loss = default_eval_step(host, batch, unpadded)
            if batch_loss is not None:
                loss_sum, count = loss_sum + batch_loss.detach().float() * unpadded, count + unpadded
                losses.add(batch_loss)
    totals = runtime.process.all_gather_object((float(loss_sum), count))
    total_count = sum(c for _, c in totals)
    result = {"loss": sum(s for s, _ in totals) / total_count} if total_count else {}
    result.update(host.metrics.eval.compute())
    host.metrics.eval.reset()
    extra = getattr(owner(host.eval_step_fn), "eval_logs", None)  # e.g. DPO's rewards
    if callable(extra):
        result.update(extra(runtime.process.collective_device))
    finite.check_validation(result, losses, runtime.process)
    return result


def detached(value: Any) -> Any:
    return value.detach().float() if isinstance(value, torch.Tensor) else float(value)


def _evaluate_pipeline(
    host: Host, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> dict[str, float]:
    """Validation loss through the pipeline: `eval_batch` over full rounds of micro-batches (a
    remainder smaller than one round is left out, so every sample that counts is real)."""
    runtime = host.runtime
    layout = runtime.pipeline_eval_layout(batch_size)
    loader = data_lib.train_loader(
        data, layout.micro_batch_size, runtime.dp_size, runtime.dp_rank, shuffle=False, collate_fn=collate_fn
    )
    calls = len(loader) // layout.accumulation_steps
    calls = calls if steps is None else min(calls, steps)
    source = data_lib.Prefetcher(iter(loader), runtime.copier, depth=host.prefetch)
    try:
        batches = data_lib.BatchIterator(source)
        losses = [runtime.eval_batch(batches) for _ in range(calls)]
    finally:
        source.close()
    mean = runtime.process.all_reduce_mean
    result = {"loss": mean(float(torch.stack(losses).float().mean()))} if losses else {}
    seen = finite.BatchLosses()
    for loss in losses:
        seen.add(loss)
    finite.check_validation(
        result, seen, runtime.process
    )  # a NaN/inf validation loss names its first batch here too
    return result


def _unpadded(loader: Any, batch: Any) -> int:
    return loader.last_unpadded if loader.last_unpadded is not None else batch_size_of(batch)


@_in_eval_mode
def predict(
    host: Host, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> list[Any]:
    """Model outputs in dataset order, one per global batch, in the structure the model returns
    them (a tensor, a tuple, a dict, a ModelOutput), on the CPU, padding trimmed from every field."""
    runtime = host.runtime
    if runtime.strategy.uses_pipeline:
        raise ConfigError(
            "predict() is not available with pipeline parallelism (outputs exist on the last stage only); "
            "save the weights and predict without a pipeline"
        )
    loader = host.dataloader(
        data, batch_size=batch_size, collate_fn=collate_fn, steps_per_epoch=steps, mode="predict"
    )
    mine: list[Any] = []
    pulled: list[int] = []  # unpadded samples of each batch the current call pulled
    batches = data_lib.BatchIterator(iter(loader), lambda batch: pulled.append(_unpadded(loader, batch)))
    call = bind_step(host.predict_step_fn) if host.predict_step_fn is not None else None
    while not batches.exhausted():
        pulled.clear()
        try:
            outputs = call(host, batches) if call is not None else default_predict_step(host, next(batches))
        except StopIteration:
            break
        watchdog.beat()
        unpadded = int(sum(pulled))  # an evaluation shard pads only its last batches: real samples first
        if outputs is not None and unpadded:
            mine.append(map_tensors(lambda t: t.detach().cpu(), take(outputs, unpadded)))
    return _in_dataset_order(mine, batch_size, host.runtime.process, host.runtime.mesh.mp_size)


def _in_dataset_order(
    mine: list[Any], batch_size: int, process: ProcessContext, mp_size: int = 1
) -> list[Any]:
    """Every data-parallel replica's outputs interleaved back into dataset order, cut into global
    batches (the `mp_size` tensor-parallel ranks of a replica hold the same outputs: one counts)."""
    shards = [concat(s) if s else None for s in process.all_gather_object(mine)][::mp_size]
    present = [s for s in shards if s is not None]
    if not present:
        return []
    total = sum(batch_size_of(s) for s in present)
    return split_samples(interleave(shards, total), batch_size)
