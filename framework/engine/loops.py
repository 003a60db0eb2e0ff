"""The training loop behind `Engine.fit`.

It works against a small protocol (`framework.engine.evaluation.Host`: the runtime, the loop state,
the metrics, the callbacks and the steps) and never imports the Engine. Each reads top to bottom: build this
rank's loader, then call the step until the data (or `max_steps`) runs out, counting what the
step really consumed. Losses stay on the device; they are read at logging points.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from framework import checkpoint
from framework.data import loaders as data_lib
from framework.data.outputs import batch_size_of
from framework.engine.evaluation import Host, evaluate
from framework.engine.fit_config import FitConfig
from framework.engine.items import step_weights
from framework.engine.steps import apply_train_result, bind_step, default_train_step
from framework.errors import NonFiniteLoss
from framework.observe.callbacks import Callback, CallbackList, Control, Event
from framework.observe.loggers import ConsoleLogger
from framework.observe.state import LoopState
from framework.observe.throughput import Speedometer
from framework.plan.run_plan import Budget, RunPlan, step_budget
from framework.process import watchdog
from framework.process.context import ProcessContext

# A step that pulls no batch this many times in a row would never end an epoch.
MAX_IDLE_CALLS = 10_000


def plan_fit(host: Host, train_data: Any, cfg: FitConfig) -> tuple[RunPlan, Any]:
    """The run's plan (every number, before DeepSpeed is built) and this rank's loader."""
    runtime = host.runtime
    runtime.start()
    layout = runtime.fix_layout(cfg.batch_size)
    loader = data_lib.train_loader(
        train_data, layout.micro_batch_size, runtime.dp_size, runtime.dp_rank, cfg.shuffle, host.seed,
        collate_fn=cfg.collate_fn, num_workers=cfg.num_workers,
    )  # fmt: skip
    budget = step_budget(layout, len(loader), cfg.epochs, cfg.steps_per_epoch, cfg.max_steps)
    resume_from = checkpoint.resolve(cfg.resume, cfg.save_dir, runtime.process) if cfg.resume else None
    universal = resume_from is not None and checkpoint.needs_universal(resume_from, runtime.mesh)
    dtype = str(runtime.compute_dtype).removeprefix("torch.")
    plan = RunPlan(runtime.mesh, layout, budget, dtype, str(resume_from) if resume_from else None, universal)
    return plan, loader


# ---------------------------------------------------------------------------------------- fit


def fit(
    host: Host, train_data: Any, valid_data: Any, cfg: FitConfig, callbacks: Iterable[Callback] = ()
) -> Any:
    """Train for `cfg.epochs` epochs or `cfg.max_steps` optimizer steps; return per-epoch history."""
    runtime, st = host.runtime, host.state
    plan, loader = plan_fit(host, train_data, cfg)  # every number first, then the parts
    if not runtime.ready:
        runtime.load_universal = plan.load_universal
    host.schedule(plan.budget.total_steps)  # before prepare: a first build gets the budget at once
    host.prepare("train", cfg.batch_size)
    _start_run(host, cfg, plan)
    speed = Speedometer(runtime, cfg.batch_size, cfg.peak_tflops)
    parts = checkpoint.Stateful(runtime, st, host.metrics)
    if plan.resume_from is not None:
        checkpoint.load(parts, Path(plan.resume_from))
        st.info.resumed_from = plan.resume_from
    events = _fit_callbacks(host, cfg, parts, callbacks, resumed=plan.resume_from is not None)
    start = time.perf_counter()
    events.fire(Event.FIT_START, st)
    if valid_data is not None and cfg.valid_at_start and st.global_step == 0:
        _validate(host, events, valid_data, cfg, history_prefix="start_")
    try:
        _epochs(host, events, loader, valid_data, cfg, plan.budget, start, speed)
    except NonFiniteLoss as exc:  # checkpoints whose weights give this NaN must not be resumed
        if exc.step is not None:
            why = f"its weights gave a NaN/inf loss at step {exc.step}"
            checkpoint.mark_bad(st.poisoned_checkpoints(exc.step), why, runtime.process)
        raise
    finally:
        runtime.timer = None
    st.elapsed_s = time.perf_counter() - start
    st.info.flops_per_step, st.info.flops_source, st.info.peak_flops = (
        speed.flops_per_step,
        speed.source,
        speed.peak,
    )
    events.fire(Event.FIT_END, st)
    return st.history


def _epochs(
    host: Host,
    events: CallbackList,
    loader: Any,
    valid_data: Any,
    cfg: FitConfig,
    budget: Budget,
    start: float,
    speed: Speedometer,
) -> None:
    st = host.state
    for epoch in range(st.epoch, cfg.epochs):
        if st.stop_training or (st.max_steps is not None and st.global_step >= st.max_steps):
            break
        resuming = epoch == st.epoch and st.batches_in_epoch > 0  # a checkpoint taken mid-epoch
        st.epoch = epoch
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        if resuming:
            _restore_position(loader, st)
        logs = train_epoch(host, events, loader, budget, cfg.log_freq, resuming, speed)
        preempted = st.stop_reason.startswith("preempted")  # leave at once: the job is being stopped
        if valid_data is not None and (epoch + 1) % cfg.valid_freq == 0 and not preempted:
            logs.update(_validate(host, events, valid_data, cfg, logs=logs))
        for key, value in logs.items():
            st.history.setdefault(key, []).append(value)
        st.logs, st.elapsed_s = dict(logs, epoch=epoch + 1), time.perf_counter() - start
        events.fire(Event.EPOCH_END, st)
        if st.stop_training:
            break


def _start_run(host: Host, cfg: FitConfig, plan: RunPlan) -> None:
    runtime, st = host.runtime, host.state
    st.epochs, st.max_steps, st.global_batch_size = cfg.epochs, cfg.max_steps, cfg.batch_size
    st.batches_per_epoch, st.history, st.stop_training, st.stop_reason = (
        plan.budget.batches_per_epoch,
        {},
        False,
        "",
    )
    assert runtime.module is not None
    st.info.model_name = type(runtime.module).__name__
    st.info.parameters = runtime.parameters
    st.info.strategy, st.info.world_size = runtime.strategy.describe(), runtime.world_size
    st.info.device_type, st.info.deepspeed_config = runtime.device.type, dict(runtime.config or {})


def _fit_callbacks(
    host: Host, cfg: FitConfig, parts: checkpoint.Stateful, extra: Iterable[Callback], resumed: bool
) -> CallbackList:
    """This fit's callbacks: the engine's, the call's, then the checkpoint manager (last, so a
    checkpoint includes this step's records); their `Control`."""
    events = CallbackList([*host.callbacks.callbacks, *extra])
    shown = any(isinstance(c, ConsoleLogger) for c in events.callbacks)
    if cfg.progress and host.runtime.process.is_main and not shown:
        events.extend(
            [ConsoleLogger()]
        )  # Engine.fit shows what the CLI shows (Paddle and Lightning print too)
    manager = None
    if cfg.save_dir is not None:
        manager = checkpoint.CheckpointManager(
            parts, cfg.save_dir, cfg.save_freq, cfg.keep_last_k, cfg.handle_preemption,
            on_saved=lambda: events.fire(Event.CHECKPOINT_SAVED, host.state),
        )  # fmt: skip
        manager.last_saved_step = host.state.global_step if resumed else -1
        events.extend([manager])
    events.control = Control(
        host.state,
        save_weights=lambda path: host.save(path, training=False),
        save_checkpoint=manager.save_now if manager is not None else None,
    )
    return events


def _validate(
    host: Host,
    events: CallbackList,
    valid_data: Any,
    cfg: FitConfig,
    logs: dict[str, Any] | None = None,
    history_prefix: str | None = None,
) -> dict[str, Any]:
    """Evaluate, fire VALIDATION_END with the val_* values in the logs, and return them."""
    host.prepare("eval")
    batch_size = cfg.valid_batch_size or cfg.batch_size
    val = {f"val_{k}": v for k, v in evaluate(host, valid_data, batch_size, None, cfg.collate_fn).items()}
    host.state.logs = {**(logs or {}), **val}
    if history_prefix is not None:
        for key, value in val.items():
            host.state.history[f"{history_prefix}{key}"] = [value]
    events.fire(Event.VALIDATION_END, host.state)
    return val


def _restore_position(loader: Any, st: LoopState) -> None:
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


# ---------------------------------------------------------------------------------------- one epoch


def train_epoch(
    host: Host,
    events: CallbackList,
    loader: Any,
    budget: Budget,
    log_freq: int,
    resuming: bool = False,
    speed: Speedometer | None = None,
) -> dict[str, Any]:
    """One epoch: call the step while batches are left (a step is never called on an empty epoch)
    and the epoch's optimizer steps are not all taken, or until training stops. `resuming`
    continues an epoch a checkpoint interrupted. A step cut short by the end of the data
    (StopIteration) counts the optimizer steps it took and drops the gradients it left open."""
    st, runtime = host.state, host.runtime
    runtime.train()
    if not resuming:
        host.metrics.train.reset()
        st.start_epoch()
    events.fire(Event.EPOCH_START, st)

    def on_fetch(batch: Any) -> None:
        st.batches_in_epoch += 1
        st.batches_fetched += 1
        st.samples_seen += batch_size_of(batch) * runtime.dp_size
        st.loader_state = batches.snapshot

    source = data_lib.Prefetcher(iter(loader), runtime.copier, host.prefetch, snapshot=loader.state_dict)
    limit = _batch_limit(host, len(loader), budget)
    batches = data_lib.BatchIterator(source, on_fetch, limit=limit - st.batches_in_epoch)
    step = _train_step_caller(host, batches)
    # A middle pipeline stage pulls no data, so every rank counts train_batch calls instead.
    pipeline_calls = budget.steps_per_epoch if runtime.strategy.uses_pipeline else None
    pending: list[Any] = []  # losses of the optimizer step in progress (dropped if fp16 skips it)
    idle_calls = 0
    try:
        while not st.stop_training:
            if _epoch_over(st, batches, pipeline_calls, budget.steps_per_epoch):
                break
            fetched, boundaries, skipped = batches.fetched, runtime.global_steps, runtime.skipped_steps
            if speed is not None and not speed.measured and batches.peek() is not None:
                speed.measure(batches.peek(), st.global_step)  # once, on the first batch
            events.fire(Event.STEP_START, st)
            try:
                with speed.counting() if speed is not None else contextlib.nullcontext():
                    loss = apply_train_result(host, _timed(step, batches, speed))
            except StopIteration:
                _cut_short(host, events, pending, boundaries, skipped, log_freq, speed)
                break
            st.step_calls += 1
            if loss is not None:
                pending.append(loss)
            _after_step(host, pending, boundaries, skipped, log_freq, speed)
            idle_calls = idle_calls + 1 if batches.fetched == fetched and pipeline_calls is None else 0
            if idle_calls >= MAX_IDLE_CALLS:
                raise RuntimeError(f"the training step pulled no batch in {MAX_IDLE_CALLS} consecutive calls")
            events.fire(Event.STEP_END, st)
    finally:
        source.close()
    return _epoch_logs(host, pending)


def _cut_short(
    host: Host, events: CallbackList, pending: list[Any], boundaries: int, skipped: int, log_freq: int,
    speed: Speedometer | None,
) -> None:  # fmt: skip
    """A step the end of the data cut short (StopIteration): the optimizer steps it took count,
    the gradients of backward passes no step closed are dropped (the next epoch starts clean)."""
    host.runtime.discard_open_step()
    _after_step(host, pending, boundaries, skipped, log_freq, speed)
    if host.runtime.global_steps > boundaries:
        events.fire(Event.STEP_END, host.state)


def _epoch_logs(host: Host, pending: list[Any]) -> dict[str, Any]:
    """The epoch's mean loss over all ranks, lr and training metrics; NaN/inf since the last
    logging point stops training here."""
    st = host.state
    for loss in pending:  # an accumulation the epoch ended in the middle of
        st.window_loss.add(loss, st.global_step)
        st.epoch_loss.add(loss, st.global_step)
    _reduced_window_loss(st, host.runtime.process)
    mean = host.runtime.process.all_reduce_mean
    logs: dict[str, Any] = {"loss": mean(st.epoch_loss.mean()), "lr": host.runtime.lr}
    logs.update(host.metrics.train.compute())
    return logs


def _batch_limit(host: Host, loader_batches: int, budget: Budget) -> int:
    """Micro-batches this epoch may hand out: the budget's for the framework's steps; for a
    custom step, which may pull any number per optimizer step, whole accumulations of the
    loader (the epoch's optimizer steps are capped by `_epoch_over`)."""
    if host.train_step_fn is None or host.runtime.strategy.uses_pipeline:
        return budget.batches_per_epoch
    acc = host.runtime.strategy.accumulation_steps
    return loader_batches // acc * acc


def _epoch_over(
    st: LoopState, batches: data_lib.BatchIterator, pipeline_calls: int | None, steps_per_epoch: int
) -> bool:
    """True when this epoch has no step left: max_steps reached, its optimizer steps taken, or
    no batch left (a pipeline: its calls done, since a middle stage pulls no data)."""
    if st.max_steps is not None and st.global_step >= st.max_steps:
        st.stop_training, st.stop_reason = True, f"reached trainer.max_steps={st.max_steps}"
        return True
    if st.steps_in_epoch >= steps_per_epoch:
        return True
    if pipeline_calls is not None:
        return st.step_calls >= pipeline_calls
    return batches.exhausted()


def _timed(step: Callable[[], Any], batches: data_lib.BatchIterator, speed: Speedometer | None) -> Any:
    """Call the step; with a speedometer, note its forward pass and its wait for data."""
    if speed is None:
        return step()
    waited, started = batches.waited, speed.timer.now()
    result = step()
    speed.timer.add("forward", started, speed.timer.now())
    speed.timer.add_host("data", batches.waited - waited)
    return result


def _after_step(
    host: Host,
    pending: list[Any],
    boundaries: int,
    skipped: int,
    log_freq: int,
    speed: Speedometer | None = None,
) -> None:
    """Count what a step call did: at an optimizer-step boundary its losses join the meters (or
    are dropped with the step, when the fp16 loss scaler skipped it); logs at logging points."""
    st, runtime = host.state, host.runtime
    watchdog.beat()
    applied_before = st.global_step
    if runtime.global_steps > boundaries:
        st.skipped_steps = runtime.skipped_steps
        st.global_step = runtime.global_steps - runtime.skipped_steps
        st.steps_in_epoch += st.global_step - applied_before
        if runtime.skipped_steps == skipped:
            for loss in pending:
                st.window_loss.add(loss, st.global_step)
                st.epoch_loss.add(loss, st.global_step)
        pending.clear()
    st.log_now = st.global_step > applied_before and st.global_step % max(1, log_freq) == 0
    st.logs = {"batches": st.batches_in_epoch, "lr": runtime.lr}
    if st.log_now:
        st.logs["loss"] = _reduced_window_loss(st, runtime.process)
        if st.skipped_steps:
            st.logs["skipped_steps"] = st.skipped_steps
        if speed is not None:
            st.logs.update(speed.logs(st.global_step))


def _reduced_window_loss(st: LoopState, process: ProcessContext) -> float:
    """The mean loss since the last logging point over all ranks (one device read); NaN/inf
    there raises NonFiniteLoss on every rank, naming the first step it appeared at."""
    bad = st.first_bad_loss()
    value = process.all_reduce_mean(st.window_loss.mean())
    st.window_loss.reset()
    if bad is not None or not math.isfinite(value):
        step = process.all_reduce_min(bad[0] if bad else st.global_step)
        raise st.non_finite_error(step, bad[1] if bad else value)
    return value


def _train_step_caller(host: Host, batches: data_lib.BatchIterator) -> Callable[[], Any]:
    """A zero-argument call of the host's step flavour on `batches`."""
    if host.runtime.strategy.uses_pipeline:
        return lambda: {"loss": host.runtime.train_batch(batches)}
    if host.train_step_fn is not None:
        call = bind_step(host.train_step_fn)
        return lambda: call(host, batches)
    rt = host.runtime
    acc, stage = rt.strategy.accumulation_steps, rt.strategy.sharding.stage
    device = rt.process.collective_device
    weights: list[Any] = []

    def default_step() -> Any:
        if not weights:  # an optimizer step begins: count the items of its global batch
            group = batches.peek_many(acc)
            found = step_weights(group, host.loss, host.module, host.label_key, rt.mesh, stage, device)
            weights.extend(found or [None] * len(group))
        batch = next(batches)
        return default_train_step(host, batch, weights.pop(0))

    return default_step
