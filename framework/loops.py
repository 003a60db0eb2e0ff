"""The training, evaluation and prediction loops behind `Engine.fit` / `evaluate` / `predict`.

Each reads top to bottom: build this rank's loader, then call the step until the data (or
`max_steps`) runs out, counting what the step really consumed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from framework import checkpoint
from framework import data as data_lib
from framework import device as dev
from framework import pipeline as pipeline_lib
from framework.callbacks import Event
from framework.steps import BatchIterator, Prefetcher, bind_step
from framework.strategy import ConfigError, batch_layout

if TYPE_CHECKING:
    from framework.engine import Engine

# A step that pulls no batch this many times in a row would never end an epoch.
MAX_IDLE_CALLS = 10_000


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: training stops at that step (the last checkpoint stays)."""


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
    valid_at_start: bool = False,
    save_dir: str | None = None,
    save_freq: int = 0,
    keep_last_k: int | None = 3,
    resume: str | None = None,
) -> dict[str, list[Any]]:
    """Train for `epochs` epochs or `max_steps` optimizer steps; return per-epoch history.

    With `save_dir`, checkpoints every `save_freq` optimizer steps and when training ends;
    `resume` ("auto" or a path) continues exactly where a checkpoint left off."""
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
    resume_from = checkpoint.resolve(resume, save_dir) if resume else None
    if resume_from is not None and engine.ds_engine is None:
        engine.load_universal = checkpoint.needs_universal(resume_from, engine)
    engine.prepare("train", batch_size)
    st = engine.state
    st.epochs, st.max_steps, st.global_batch_size = epochs, max_steps, batch_size
    st.batches_per_epoch, st.history, st.stop_training = batches_per_epoch, {}, False
    if resume_from is not None:
        checkpoint.load(engine, resume_from)
        engine.resumed_from = str(resume_from)
    if save_dir is not None:
        manager = checkpoint.CheckpointManager(
            save_dir, save_freq, keep_last_k, handle_preemption=engine.handle_preemption
        )
        manager.last_saved_step = st.global_step if resume_from is not None else -1
        engine.callbacks.append(manager)  # after the loggers: a checkpoint includes this step's records
    start = time.perf_counter()
    engine.fire(Event.FIT_START)
    if valid_data is not None and valid_at_start and st.global_step == 0:
        val = engine.evaluate(valid_data, batch_size=valid_batch_size or batch_size, collate_fn=collate_fn)
        st.logs = {f"val_{k}": v for k, v in val.items()}
        for key, value in st.logs.items():
            st.history[f"start_{key}"] = [value]
        engine.fire(Event.VALIDATION_END)
    for epoch in range(st.epoch, epochs):
        if st.stop_training or (st.max_steps is not None and st.global_step >= st.max_steps):
            break
        resuming = epoch == st.epoch and st.batches_in_epoch > 0  # a checkpoint taken mid-epoch
        st.epoch = epoch
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        if resuming:
            _restore_position(loader, st)
        logs = train_epoch(engine, loader, batches_per_epoch, log_freq, resuming)
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


def _restore_position(loader: Any, st: Any) -> None:
    """Put the loader where the checkpoint's step left it: its saved state (same world size), or
    the same global sample skipped to (another world size)."""
    if st.loader_state is not None:
        loader.load_state_dict(st.loader_state)
        return
    skipped = st.batches_in_epoch
    state = loader.state_dict()
    state.update(
        _sampler_iter_state={"samples_yielded": skipped * loader.batch_size},
        _sampler_iter_yielded=skipped,
        _num_yielded=skipped,
    )
    loader.load_state_dict(state)


def train_epoch(
    engine: Engine, loader: Any, batches_per_epoch: int, log_freq: int, resuming: bool = False
) -> dict[str, Any]:
    """One epoch: call the step until the loader is exhausted (StopIteration) or training stops.
    `resuming` continues an epoch a checkpoint interrupted (its counters and metrics restored)."""
    st = engine.state
    engine.model.train()
    if not resuming:
        engine.reset_metrics()
        st.batches_in_epoch = st.step_calls = 0
        st.epoch_loss_sum, st.epoch_loss_count, st.window_loss_sum, st.window_loss_count = 0.0, 0, 0.0, 0
    engine.fire(Event.EPOCH_START)

    def on_fetch(batch: Any) -> None:
        st.batches_in_epoch += 1
        st.batches_fetched += 1
        st.samples_seen += data_lib.batch_size_of(batch) * engine.dp_size
        st.loader_state = source.last_snapshot

    source = Prefetcher(iter(loader), engine.transfer, depth=engine.prefetch, snapshot=loader.state_dict)
    batches = BatchIterator(source, on_fetch, limit=batches_per_epoch - st.batches_in_epoch)
    step = _train_step_caller(engine, batches)
    # A middle pipeline stage pulls no data, so every rank counts train_batch calls instead.
    calls_per_epoch = (
        batches_per_epoch // engine.strategy.accumulation_steps if engine.strategy.uses_pipeline else None
    )
    idle_calls = 0
    try:
        while not st.stop_training:
            if st.max_steps is not None and st.global_step >= st.max_steps:
                st.stop_training, st.stop_reason = True, f"reached trainer.max_steps={st.max_steps}"
                break
            if calls_per_epoch is not None and st.step_calls >= calls_per_epoch:
                break
            fetched_before, steps_before = batches.fetched, engine.ds_engine.global_steps
            skipped_before = engine.ds_engine.skipped_steps
            engine.fire(Event.STEP_START)
            try:
                loss_value = consume_result(engine, step())
            except StopIteration:
                break
            if loss_value is not None and not math.isfinite(loss_value):
                if engine.ds_engine.skipped_steps > skipped_before:  # fp16 overflow: the scaler skipped it
                    loss_value = None
                else:
                    raise NonFiniteLoss(
                        f"loss became {loss_value} at step {engine.ds_engine.global_steps} (epoch {st.epoch + 1}, "
                        f"batch {st.batches_in_epoch}); training stopped, last good checkpoint: "
                        f"{st.last_checkpoint or 'none yet'}. Try a lower optimizer.lr or strategy.gradient_clip.max_norm=1.0"
                    )
            st.step_calls += 1
            if loss_value is not None:
                st.epoch_loss_sum, st.epoch_loss_count = (
                    st.epoch_loss_sum + loss_value,
                    st.epoch_loss_count + 1,
                )
                st.window_loss_sum, st.window_loss_count = (
                    st.window_loss_sum + loss_value,
                    st.window_loss_count + 1,
                )
            idle_calls = (
                idle_calls + 1 if batches.fetched == fetched_before and calls_per_epoch is None else 0
            )
            if idle_calls >= MAX_IDLE_CALLS:
                raise RuntimeError(f"the training step pulled no batch in {MAX_IDLE_CALLS} consecutive calls")
            st.global_step = engine.ds_engine.global_steps
            st.log_now = st.global_step > steps_before and st.global_step % max(1, log_freq) == 0
            st.logs = {"batches": st.batches_in_epoch, "lr": engine.lr}
            if st.log_now:
                st.logs["loss"] = dev.all_reduce_mean(st.window_loss_sum / max(st.window_loss_count, 1))
                st.window_loss_sum, st.window_loss_count = 0.0, 0
            engine.fire(Event.STEP_END)
    finally:
        source.close()
    logs: dict[str, Any] = {
        "loss": dev.all_reduce_mean(st.epoch_loss_sum / max(st.epoch_loss_count, 1)),
        "lr": engine.lr,
    }
    logs.update(engine.compute_metrics())
    return logs


def _train_step_caller(engine: Engine, batches: BatchIterator) -> Callable[[], Any]:
    """A zero-argument call of this engine's step flavour on `batches`."""
    step_fn = engine.train_step_fn
    if engine.strategy.uses_pipeline:
        return lambda: float(pipeline_lib.train_batch(engine.ds_engine, batches))
    if step_fn is not None:
        call = bind_step(step_fn)
        return lambda: call(engine, batches)
    return lambda: engine.default_train_step(next(batches))


def consume_result(engine: Engine, result: Any) -> float | None:
    """Act on what a training step returned: a loss tensor is backpropagated and stepped; a dict
    (the step optimised itself) is only logged; a float is a loss the pipeline engine already
    stepped on."""
    if isinstance(result, torch.Tensor):
        engine.auto_step(result)
        return float(result.detach().float().item())
    if isinstance(result, dict):
        loss = result.get("loss")
        if isinstance(loss, torch.Tensor):
            return float(loss.detach().float().item())
        return float(loss) if loss is not None else None
    if result is None or isinstance(result, float):
        return result
    raise TypeError(f"a training step must return a loss tensor, a dict or None, got {type(result).__name__}")


@torch.no_grad()
def evaluate(
    engine: Engine, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> dict[str, float]:
    """Loss and metrics over `data`, every sample counted once across all ranks."""
    if engine.strategy.uses_pipeline:
        return _evaluate_pipeline(engine, data, batch_size, steps, collate_fn)
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
        call = bind_step(step_fn)
        while True:
            try:
                result = call(engine, batches)
            except StopIteration:
                break
            value = result.get("loss") if isinstance(result, dict) else result
            if value is not None:
                loss_sum, count = loss_sum + float(value), count + 1
    else:
        for batch in loader:
            real = _real_in(loader, batch)
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


def _evaluate_pipeline(
    engine: Engine, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> dict[str, float]:
    """Validation loss through the pipeline: `eval_batch` over full rounds of micro-batches (a
    remainder smaller than one round is left out, so every sample that counts is real)."""
    layout = batch_layout(engine.strategy, batch_size, engine.world_size)
    loader = data_lib.train_loader(
        data, layout.micro_batch_size, engine.dp_size, engine.dp_rank, shuffle=False, collate_fn=collate_fn
    )
    calls = len(loader) // layout.accumulation_steps
    if steps is not None:
        calls = min(calls, steps)
    was_training = engine.module.training
    source = Prefetcher(iter(loader), engine.transfer, depth=engine.prefetch)
    losses = []
    try:
        for _ in range(calls):
            losses.append(float(pipeline_lib.eval_batch(engine.ds_engine, source)))
    finally:
        source.close()
    engine.model.train(was_training)
    return {"loss": dev.all_reduce_mean(sum(losses) / len(losses))} if losses else {}


def _real_in(loader: Any, batch: Any) -> int:
    return loader.last_real if loader.last_real is not None else data_lib.batch_size_of(batch)


@torch.no_grad()
def predict(
    engine: Engine, data: Any, batch_size: int, steps: int | None, collate_fn: Callable | None
) -> list[Any]:
    """Model outputs in dataset order, one CPU tensor per global batch."""
    if engine.strategy.uses_pipeline:
        raise ConfigError(
            "predict() is not available with pipeline parallelism (outputs exist on the last stage only); "
            "save the weights and predict without a pipeline"
        )
    was_training = engine.module.training
    engine.model.eval()
    loader = engine.dataloader(
        data, batch_size=batch_size, collate_fn=collate_fn, steps_per_epoch=steps, mode="predict"
    )
    mine: list[torch.Tensor] = []
    step_fn = engine.predict_step_fn
    if step_fn is None:
        for batch in loader:
            inputs, _ = data_lib.split_batch(batch)
            outputs = engine.model(*inputs)
            if loader.last_real:
                mine.append(outputs[: loader.last_real].detach().float().cpu())
    else:  # a custom predict step, given one batch or the iterator
        pulled: list[int] = []  # real samples of each batch the current call pulled
        batches = BatchIterator(iter(loader), lambda batch: pulled.append(_real_in(loader, batch)))
        call = bind_step(step_fn)
        while True:
            pulled.clear()
            try:
                outputs = call(engine, batches)
            except StopIteration:
                break
            # An evaluation shard pads only its last batches, so the real samples come first.
            real = int(sum(pulled))
            if outputs is not None and real:
                mine.append(outputs[:real].detach().float().cpu())
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
