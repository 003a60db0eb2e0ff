"""The training, evaluation and prediction loops behind `Engine.fit` / `evaluate` / `predict`.

Each reads top to bottom: build this rank's loader, then call the step until the data (or
`max_steps`) runs out, counting what the step really consumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from framework import data as data_lib
from framework import device as dev
from framework.callbacks import Event
from framework.steps import BatchIterator, Prefetcher, takes_iterator
from framework.strategy import batch_layout

if TYPE_CHECKING:
    from framework.engine import Engine

# A step that pulls no batch this many times in a row would never end an epoch.
MAX_IDLE_CALLS = 10_000


def fit(
    engine: Engine,
    train_data: Any,
    valid_data: Any,
    epochs: int,
    batch_size: int,
    steps_per_epoch: int | None,
    valid_freq: int,
    log_freq: int,
    max_steps: int | None,
    valid_batch_size: int | None,
    shuffle: bool,
    collate_fn: Callable | None,
    num_workers: int,
) -> dict[str, list[Any]]:
    """Train for `epochs` epochs or `max_steps` optimizer steps; return per-epoch history."""
    dev.init_process_group()
    layout = batch_layout(engine.strategy, batch_size, engine.world_size)
    loader = data_lib.train_loader(
        train_data,
        layout.micro_batch_size,
        engine.dp_size,
        engine.dp_rank,
        shuffle,
        engine.seed,
        collate_fn=collate_fn,
        num_workers=num_workers,
    )
    batches_per_epoch = len(loader)
    if steps_per_epoch is not None:
        batches_per_epoch = min(batches_per_epoch, steps_per_epoch * layout.accumulation_steps)
    total = epochs * max(1, batches_per_epoch // layout.accumulation_steps)
    engine.total_steps = min(total, max_steps) if max_steps else total
    engine.prepare("train", batch_size)
    st = engine.state
    st.epochs, st.max_steps, st.global_batch_size = epochs, max_steps, batch_size
    st.batches_per_epoch, st.history, st.stop_training = batches_per_epoch, {}, False
    start = time.perf_counter()
    engine.fire(Event.FIT_START)
    for epoch in range(st.epoch, epochs):
        st.epoch = epoch
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        logs = train_epoch(engine, loader, batches_per_epoch, log_freq)
        if valid_data is not None and (epoch + 1) % valid_freq == 0:
            val = engine.evaluate(
                valid_data, batch_size=valid_batch_size or batch_size, collate_fn=collate_fn
            )
            logs.update({f"val_{k}": v for k, v in val.items()})
            st.logs = dict(logs)
            engine.fire(Event.VALIDATION_END)
        for key, value in logs.items():
            st.history.setdefault(key, []).append(value)
        st.logs = dict(logs, epoch=epoch + 1)
        st.elapsed_s = time.perf_counter() - start
        engine.fire(Event.EPOCH_END)
        if st.stop_training:
            break
    st.elapsed_s = time.perf_counter() - start
    engine.fire(Event.FIT_END)
    return st.history


def train_epoch(engine: Engine, loader: Any, batches_per_epoch: int, log_freq: int) -> dict[str, Any]:
    """One epoch: call the step until the loader is exhausted (StopIteration) or training stops."""
    st = engine.state
    engine.model.train()
    engine.reset_metrics()
    st.batches_in_epoch = st.step_calls = 0
    engine.fire(Event.EPOCH_START)

    def on_fetch(batch: Any) -> None:
        st.batches_in_epoch += 1
        st.batches_fetched += 1
        st.samples_seen += data_lib.batch_size_of(batch) * engine.dp_size

    source = Prefetcher(iter(loader), engine.transfer, depth=engine.prefetch)
    batches = BatchIterator(source, on_fetch, limit=batches_per_epoch)
    step_fn = engine.train_step_fn
    iterator_step = step_fn is not None and takes_iterator(step_fn)
    epoch_loss, epoch_calls, window_loss, window_calls, idle_calls = 0.0, 0, 0.0, 0, 0
    try:
        while not st.stop_training:
            if st.max_steps is not None and st.global_step >= st.max_steps:
                st.stop_training, st.stop_reason = True, f"reached trainer.max_steps={st.max_steps}"
                break
            fetched_before, steps_before = batches.fetched, engine.ds_engine.global_steps
            try:
                if iterator_step:
                    result = step_fn(engine, batches)  # type: ignore[misc]
                else:
                    batch = next(batches)
                    result = (
                        step_fn(engine, batch) if step_fn is not None else engine.default_train_step(batch)
                    )
            except StopIteration:
                break
            loss_value = consume_result(engine, result)
            st.step_calls += 1
            if loss_value is not None:
                epoch_loss, epoch_calls = epoch_loss + loss_value, epoch_calls + 1
                window_loss, window_calls = window_loss + loss_value, window_calls + 1
            idle_calls = idle_calls + 1 if batches.fetched == fetched_before else 0
            if idle_calls >= MAX_IDLE_CALLS:
                raise RuntimeError(f"the training step pulled no batch in {MAX_IDLE_CALLS} consecutive calls")
            st.global_step = engine.ds_engine.global_steps
            st.log_now = st.global_step > steps_before and st.global_step % max(1, log_freq) == 0
            st.logs = {"batches": st.batches_in_epoch, "lr": engine.lr}
            if st.log_now:
                st.logs["loss"] = dev.all_reduce_mean(window_loss / max(window_calls, 1))
                window_loss, window_calls = 0.0, 0
            engine.fire(Event.STEP_END)
    finally:
        source.close()
    logs: dict[str, Any] = {"loss": dev.all_reduce_mean(epoch_loss / max(epoch_calls, 1)), "lr": engine.lr}
    logs.update(engine.compute_metrics())
    return logs


def consume_result(engine: Engine, result: Any) -> float | None:
    """Act on what a training step returned: a loss tensor is backpropagated and stepped; a dict
    (the step optimised itself) is only logged."""
    if isinstance(result, torch.Tensor):
        engine.auto_step(result)
        return float(result.detach().float().item())
    if isinstance(result, dict):
        loss = result.get("loss")
        if isinstance(loss, torch.Tensor):
            return float(loss.detach().float().item())
        return float(loss) if loss is not None else None
    if result is None:
        return None
    raise TypeError(f"a training step must return a loss tensor, a dict or None, got {type(result).__name__}")


@torch.no_grad()
def evaluate(
    engine: Engine, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> dict[str, float]:
    """Loss and metrics over `data`, every sample counted once across all ranks."""
    was_training = engine.module.training
    engine.model.eval()
    engine.reset_metrics()
    loader = engine.dataloader(
        data, batch_size=batch_size, collate_fn=collate_fn, steps_per_epoch=steps, mode="eval"
    )
    loss_sum, count = 0.0, 0
    step_fn = engine.eval_step_fn
    if step_fn is not None:  # a custom validation step: average what it returns
        batches = BatchIterator(iter(loader), lambda batch: None)
        iterator_step = takes_iterator(step_fn)
        while True:
            try:
                result = step_fn(engine, batches) if iterator_step else step_fn(engine, next(batches))
            except StopIteration:
                break
            value = result.get("loss") if isinstance(result, dict) else result
            if value is not None:
                loss_sum, count = loss_sum + float(value), count + 1
    else:
        for batch in loader:
            real = loader.last_real if loader.last_real is not None else data_lib.batch_size_of(batch)
            _, batch_loss = engine.eval_batch(batch, real)
            if batch_loss is not None:
                loss_sum, count = loss_sum + batch_loss * real, count + real
    totals = dev.all_gather_object((loss_sum, count))
    total_count = sum(c for _, c in totals)
    result = {"loss": sum(s for s, _ in totals) / total_count} if total_count else {}
    result.update(engine.compute_metrics())
    engine.reset_metrics()
    engine.model.train(was_training)
    return result


@torch.no_grad()
def predict(
    engine: Engine, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> list[Any]:
    """Model outputs in dataset order, one CPU tensor per global batch."""
    was_training = engine.module.training
    engine.model.eval()
    loader = engine.dataloader(
        data, batch_size=batch_size, collate_fn=collate_fn, steps_per_epoch=steps, mode="predict"
    )
    mine: list[torch.Tensor] = []
    for batch in loader:
        inputs, _ = data_lib.split_batch(batch)
        outputs = engine.model(*inputs)
        if loader.last_real:
            mine.append(outputs[: loader.last_real].detach().float().cpu())
    engine.model.train(was_training)
    shards = [torch.cat(s) if s else None for s in dev.all_gather_object(mine)]
    present = [s for s in shards if s is not None]
    if not present:
        return []
    dp = engine.dp_size
    out = present[0].new_empty((sum(len(s) for s in present), *present[0].shape[1:]))
    for r, shard in enumerate(shards):
        if shard is not None:  # rank r held samples r, r + dp, r + 2 dp, ...
            out[r : r + len(shard) * dp : dp] = shard
    return list(out.split(batch_size))
