"""Paddle's fine-grained API behind `Engine.dataloader` / `dataloader_from_generator` / `run`:
the user owns the loop, the framework gives this rank's batches on the device and runs one
step at a time. Functions of the `framework.engine.evaluation.Host` protocol; no Engine import.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from framework.backend.ds_config import configures_optimizer
from framework.data import loaders as data_lib
from framework.data.device_loader import DeviceLoader
from framework.data.outputs import batch_size_of, take
from framework.data.streams import SHUFFLE_WINDOW, is_stream
from framework.engine import fetches
from framework.engine.evaluation import Host, detached, eval_mode
from framework.engine.items import counted_windows, step_weights
from framework.engine.steps import (
    apply_train_result,
    bind_step,
    counter_of,
    default_eval_step,
    default_predict_step,
    default_train_step,
)
from framework.errors import ConfigError
from framework.plan.run_plan import eval_split

MODES = ("train", "eval", "predict")


def check_mode(mode: str) -> str:
    """`mode` if it is one of train / eval / predict, else a ValueError listing them."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of 'train', 'eval', 'predict'")
    return mode


def prepare(host: Any, mode: str, batch_size: int | None) -> None:
    """Build DeepSpeed for `mode` once (see `Engine.prepare`): what the mode needs is checked,
    the batch layout fixed for training, the model, metrics and loss placed, the learning-rate
    schedule given its budget."""
    runtime = host.runtime
    has_optimizer = host.optimizer_spec is not None or configures_optimizer(runtime.strategy)
    if mode == "train" and (host.loss is None and host.train_step_fn is None or not has_optimizer):
        raise ConfigError("set optimizer and loss before training (Engine(model, loss, optimizer, ...))")
    if mode == "eval" and host.loss is None and host.eval_step_fn is None:
        raise ConfigError("set loss before evaluation (Engine(model, loss, ...))")
    host.mode = mode
    runtime.start()
    if mode == "train" and batch_size is not None:
        runtime.fix_layout(batch_size)
    if not runtime.ready:
        runtime.initialize(host.module, host.optimizer_spec if has_optimizer else None, host.loss)
        host.metrics.to(runtime.device)
        if isinstance(getattr(host.loss, "fn", None), torch.nn.Module):
            host.loss.fn.to(runtime.device)
    if mode == "train" and host._scheduled_for is None:
        host.schedule(host.total_steps)
    host._prepared.add(mode)


class PaddingTracker:
    """Remembers the evaluation loaders handed out, to tell how many samples of a batch one of
    them just yielded are not padding."""

    def __init__(self) -> None:
        self._loaders: list[weakref.ref[DeviceLoader]] = []

    def track(self, loader: DeviceLoader) -> DeviceLoader:
        """Remember `loader`; returns it."""
        self._loaders = [r for r in self._loaders if r() is not None] + [weakref.ref(loader)]
        return loader

    def unpadded(self, batch: Any) -> int:
        """Samples of `batch` that are not padding: all, unless a tracked loader just padded it."""
        for ref in self._loaders:
            loader = ref()
            if loader is not None and loader.last_batch is batch and loader.last_unpadded is not None:
                return loader.last_unpadded
        return batch_size_of(batch)


def dataloader(
    host: Host,
    dataset: Any,
    batch_size: int,
    mode: str,
    shuffle: bool = False,
    collate_fn: Callable | None = None,
    num_workers: int = 0,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
) -> DeviceLoader:
    """This rank's share of `dataset` for `mode` (see `Engine.dataloader`); prepares `mode`."""
    check_mode(mode)
    runtime = host.runtime
    runtime.start()
    metrics = host.metrics.for_mode(mode)
    if is_stream(dataset):
        return _stream_dataloader(
            host, dataset, batch_size, mode, shuffle, collate_fn, num_workers, epochs, steps_per_epoch
        )
    if mode == "train":
        layout = runtime.fix_layout(batch_size)
        per_rank = layout.micro_batch_size * layout.accumulation_steps
        loader: Any = data_lib.train_loader(
            dataset,
            per_rank,
            runtime.dp_size,
            runtime.dp_rank,
            shuffle,
            host.seed,
            True,
            collate_fn,
            num_workers,
        )
        host.schedule(epochs * min(len(loader), steps_per_epoch or len(loader)))  # one step per batch
        host.prepare(mode, batch_size)
        unpadded = None
    else:
        per_rank = eval_split(runtime.mesh, batch_size)
        host.prepare(mode)
        loader = data_lib.eval_loader(
            dataset, per_rank, runtime.dp_size, runtime.dp_rank, collate_fn, num_workers
        )
        unpadded = loader.sampler.unpadded
    return DeviceLoader(
        loader,
        runtime.copier,
        epochs,
        steps_per_epoch,
        host.prefetch,
        batch_size,
        unpadded,
        on_epoch=lambda _: metrics.reset(),
    )


def _stream_dataloader(
    host: Host,
    data: Any,
    batch_size: int,
    mode: str,
    shuffle: bool,
    collate_fn: Callable | None,
    num_workers: int,
    epochs: int,
    steps_per_epoch: int | None,
) -> DeviceLoader:
    """`dataloader` over a stream: a training pass ends on every rank at the first batch one of
    them lacks; evaluation pads the ranks whose stream ended until every rank's has."""
    runtime, metrics = host.runtime, host.metrics.for_mode(mode)
    train = mode == "train"
    if train:
        if steps_per_epoch is None:
            raise ConfigError(
                "dataloader(<a stream>, mode='train') needs steps_per_epoch: a stream has no length, and "
                "the learning-rate schedule needs the number of steps"
            )
        layout = runtime.fix_layout(batch_size)
        per_rank = layout.micro_batch_size * layout.accumulation_steps
        host.schedule(epochs * steps_per_epoch)  # one optimizer step per batch
    else:
        per_rank = eval_split(runtime.mesh, batch_size)
    window = SHUFFLE_WINDOW if shuffle and train else 0
    loader = data_lib.stream_loader(
        data,
        per_rank,
        runtime.dp_size,
        runtime.dp_rank,
        window,
        host.seed,
        collate_fn,
        num_workers,
        drop_last=train,
        to_the_end=mode == "eval",  # every sample counts once; predict keeps the order
    )
    host.prepare(mode, batch_size if train else None)
    return DeviceLoader(
        loader,
        runtime.copier,
        epochs,
        steps_per_epoch,
        host.prefetch,
        batch_size,
        on_epoch=lambda _: metrics.reset(),
        agree=runtime.process.all_ranks,
        pad=not train,
    )


def generator_loader(
    host: Host,
    generator: Any,
    batch_size: int,
    mode: str,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    collate_fn: Callable | None = None,
) -> DeviceLoader:
    """Samples of a Python generator dealt round-robin to ranks (see `Engine.dataloader_from_generator`)."""
    check_mode(mode)
    runtime = host.runtime
    runtime.start()
    if mode == "train":
        layout = runtime.fix_layout(batch_size)
        per_rank = layout.micro_batch_size * layout.accumulation_steps
    else:
        per_rank = eval_split(runtime.mesh, batch_size)
    source = data_lib.GeneratorDataset(generator, runtime.dp_size, runtime.dp_rank)
    loader = torch.utils.data.DataLoader(
        source, batch_size=per_rank, drop_last=True, collate_fn=collate_fn, generator=data_lib.own_generator()
    )
    host.prepare(mode, batch_size if mode == "train" else None)
    return DeviceLoader(loader, runtime.copier, epochs, steps_per_epoch, host.prefetch, batch_size)


def run(
    host: Host,
    data: Any,
    feed: dict[str, Any] | None,
    fetch_list: list[str] | None,
    mode: str | None,
    prepared: set[str],
    padding: PaddingTracker,
) -> dict[str, Any]:
    """One step of `mode` on `data` (or `feed`) with `fetch_list`'s values (see `Engine.run`)."""
    if mode is None or (mode in MODES and mode not in prepared):
        raise ConfigError(
            f"nothing is prepared for mode {mode or 'train'!r}: call engine.prepare(mode=...) "
            "or engine.dataloader(..., mode=...) first"
        )
    check_mode(mode)
    if data is None and feed is not None:
        data = (feed["inputs"], feed["labels"]) if "labels" in feed else feed["inputs"]
    if data is None:
        raise ValueError("run() needs a batch: run(batch) or run(feed={'inputs': x, 'labels': y})")
    unpadded = padding.unpadded(data)
    runtime = host.runtime
    if mode == "train" and not runtime.layout_fixed:  # prepared without a batch size
        runtime.fix_layout(batch_size_of(data) * runtime.dp_size)
    runtime.grad_norm_wanted = "grad_norm" in (fetch_list or ())
    try:
        assert runtime.module is not None
        with fetches.capture(runtime.module, fetch_list) as captured:
            logs = run_one(host, runtime.transfer(data), mode, unpadded)
    finally:
        runtime.grad_norm_wanted = False
    logs["fetches"] = fetches.collect(fetch_list, captured, runtime)
    return logs


def _train_call(host: Host, micros: list[Any]) -> tuple[Callable[[Any, Any], Any], Any]:
    """How `run` calls the training step on one micro-batch, `call(micro, weight)`, and the
    micro-batches' weights: the framework's step and a method with `items` weigh each by its
    share of the global batch's items (`framework.engine.items`); other steps get none."""
    runtime, step = host.runtime, host.train_step_fn
    device = runtime.process.collective_device
    if step is None:
        weights = step_weights(micros, host.loss, host.module, host.label_key, runtime.mesh, device)
        return functools.partial(default_train_step, host), weights
    items = counter_of(step)
    if items is not None:
        found = counted_windows([micros], items, runtime.mesh, device=device)
        return (lambda micro, w: step(host, micro, w() if callable(w) else w)), (found[0] if found else None)
    call = bind_step(step)
    return (lambda micro, _: call(host, iter([micro]))), None


def run_one(host: Host, batch: Any, mode: str, unpadded: int) -> dict[str, Any]:
    """Exactly one step of `mode` on a batch already on the device (see `Engine.run`)."""
    runtime = host.runtime
    if mode == "train":
        runtime.train()
        assert runtime.layout is not None
        micros = data_lib.split_micro_batches(batch, runtime.layout.accumulation_steps)
        call, weights = _train_call(host, micros)
        losses = []
        for i, micro in enumerate(micros):
            result: Any = call(micro, weights.weight(i) if weights is not None else None)
            value = apply_train_result(host, result)
            if value is not None:
                losses.append(detached(value))
        loss = float(sum(losses) / len(losses)) if losses else None
        return {"loss": loss, **host.metrics.train.compute()}
    with torch.no_grad(), eval_mode(runtime):
        if mode == "eval":
            _, batch_loss = default_eval_step(host, batch, unpadded)
            logs: dict[str, Any] = {"loss": None if batch_loss is None else float(batch_loss)}
            logs.update(host.metrics.eval.compute())
        elif host.predict_step_fn is not None:  # the same step predict() uses
            logs = {"outputs": take(bind_step(host.predict_step_fn)(host, iter([batch])), unpadded)}
        else:
            logs = {"outputs": take(default_predict_step(host, batch), unpadded)}
    return logs
