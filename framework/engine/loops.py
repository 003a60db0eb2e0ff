"""The training loop behind `Engine.fit`.

It works against a small protocol (`framework.engine.evaluation.Host`: the runtime, the loop state,
the metrics, the callbacks and the steps) and never imports the Engine. Each reads top to bottom: build this
rank's loader, then call the step until the data (or `max_steps`) runs out, counting what the
step really consumed. Losses stay on the device; they are read at logging points.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch.utils.data import default_collate

from framework import checkpoint
from framework.data import loaders as data_lib
from framework.data.device_loader import set_epoch
from framework.data.stream_loader import StreamLoader
from framework.data.streams import is_stream
from framework.engine.epoch import agree_each_step, agree_stop, train_epoch
from framework.engine.evaluation import Host, evaluate
from framework.engine.fit_config import FitConfig
from framework.engine.steps import owner
from framework.errors import CheckpointError, ConfigError, NonFiniteLoss
from framework.observe.callbacks import Callback, CallbackList, Control, Event
from framework.observe.loggers import ConsoleLogger
from framework.observe.state import LoopState
from framework.observe.throughput import Speedometer
from framework.plan.run_plan import Budget, RunPlan, step_budget, stream_budget, warmup_note


def rows_per_batch(host: Host, batch_size: int) -> int:
    """The data rows of a global batch of `batch_size`: the same, unless the training step counts
    its batch in other units (a method's `rows_per_batch`: GRPO's batch counts completions, G per
    prompt row)."""
    rows = getattr(host.train_step_fn, "rows_per_batch", None)
    return int(rows(batch_size)) if callable(rows) else batch_size


def _with_updates(budget: Budget, host: Host) -> Budget:
    """The budget of a step that takes several optimizer steps per global batch of data (a
    method's `updates_per_batch`: GRPO's num_iterations)."""
    updates = getattr(host.train_step_fn, "updates_per_batch", None)
    times = int(updates()) if callable(updates) else 1
    if times == 1:
        return budget
    per_epoch = None if budget.steps_per_epoch is None else budget.steps_per_epoch * times
    total = (
        budget.total_steps * times
        if budget.max_steps is None
        else min(budget.total_steps * times, budget.max_steps)
    )
    return dataclasses.replace(budget, steps_per_epoch=per_epoch, total_steps=total)


def plan_fit(host: Host, train_data: Any, cfg: FitConfig) -> tuple[RunPlan, Any]:
    """The run's plan (every number, before DeepSpeed is built) and this rank's loader."""
    runtime = host.runtime
    runtime.start()
    layout = runtime.fix_layout(rows_per_batch(host, cfg.batch_size))
    if is_stream(train_data):  # iterable data: the budget comes from max_steps (or steps_per_epoch)
        if runtime.strategy.uses_pipeline:
            raise ConfigError(
                "pipeline parallelism needs map-style data (a stream's end cannot be told to the middle stages)"
            )
        window = cfg.shuffle_window if cfg.shuffle else 0
        loader: Any = data_lib.stream_loader(
            train_data,
            layout.micro_batch_size,
            runtime.dp_size,
            runtime.dp_rank,
            window,
            host.seed,
            cfg.collate_fn,
            cfg.num_workers,
        )
        budget = stream_budget(layout, cfg.epochs, cfg.steps_per_epoch, cfg.max_steps)
    else:
        loader = data_lib.train_loader(
            train_data,
            layout.micro_batch_size,
            runtime.dp_size,
            runtime.dp_rank,
            cfg.shuffle,
            host.seed,
            collate_fn=cfg.collate_fn,
            num_workers=cfg.num_workers,
        )
        samples = data_lib.dataset_len(train_data)
        budget = step_budget(layout, len(loader), cfg.epochs, cfg.steps_per_epoch, cfg.max_steps, samples)
    budget = _with_updates(budget, host)
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
    host.prepare("train", rows_per_batch(host, cfg.batch_size))
    prepared = _method_data(host, cfg, train_data, valid_data)  # before a resume loads the policy
    if prepared[0] is not train_data:
        plan, loader = plan_fit(host, prepared[0], cfg)
    valid_data = prepared[1]
    _start_run(host, cfg, plan, has_valid=valid_data is not None)
    speed = Speedometer(runtime, cfg.batch_size, cfg.peak_tflops)
    parts = checkpoint.Stateful(runtime, st, host.metrics, owner(host.train_step_fn))
    if plan.resume_from is not None:
        checkpoint.load(parts, Path(plan.resume_from))
        st.info.resumed_from = plan.resume_from
    events = _fit_callbacks(host, cfg, parts, callbacks, resumed=plan.resume_from is not None)
    events.agree_each_step = agree_each_step(host, events)
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


def _method_data(host: Host, cfg: FitConfig, train_data: Any, valid_data: Any) -> tuple[Any, Any]:
    """The training and validation data as the training method wants them (its `prepare_data`,
    e.g. DPO's reference log-probabilities computed by the model before its first step), given
    one per-rank batch of samples at a time; the data as they are for any other step."""
    prepare = getattr(host.train_step_fn, "prepare_data", None)
    if not callable(prepare):
        return train_data, valid_data
    chunk = max(1, rows_per_batch(host, cfg.batch_size) // host.runtime.dp_size)
    collate = cfg.collate_fn or default_collate
    train = prepare(host, train_data, chunk, collate)
    valid = prepare(host, valid_data, chunk, collate) if valid_data is not None else None
    return train, valid


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
        set_epoch(loader, epoch)
        if resuming:
            _restore_position(loader, st)
        logs = train_epoch(host, events, loader, budget, cfg.log_freq, resuming, speed)
        if st.global_step == st.skipped_steps == 0 and not st.stop_training:  # a run that did not happen
            raise ConfigError(_no_step(loader, cfg, st.skipped_batches))
        preempted = st.stop_reason.startswith("preempted")  # leave at once: the job is being stopped
        if valid_data is not None and (epoch + 1) % cfg.valid_freq == 0 and not preempted:
            logs.update(_validate(host, events, valid_data, cfg, logs=logs))
        for key, value in logs.items():
            st.history.setdefault(key, []).append(value)
        st.logs, st.elapsed_s = dict(logs, epoch=epoch + 1), time.perf_counter() - start
        events.fire(Event.EPOCH_END, st)
        if agree_stop(st, host.runtime.process):
            break
    if not st.stop_reason:  # the epochs ended it: the final line says so, and what it left unreached
        unreached = st.max_steps is not None and st.global_step < st.max_steps
        st.stop_reason = f"after trainer.epochs={cfg.epochs}" + (
            f"; trainer.max_steps={st.max_steps} not reached" if unreached else ""
        )


def _no_step(loader: Any, cfg: FitConfig, skipped: int = 0) -> str:
    """Why a pass trained no optimizer step, in one line: the training step skipped the batches
    it was given (`skipped` of them), or the data ran out before one global batch."""
    if skipped:
        return (
            f"no optimizer step was trained: the training step skipped the {skipped:,} batch(es) it was given "
            "(it returned None, which skips a batch); return the batch's loss to train on it"
        )
    what = "the training stream" if isinstance(loader, StreamLoader) else "the training data"
    return (
        f"no optimizer step was trained: {what} ran out (on some rank) before one global batch of "
        f"{cfg.batch_size} samples; give more data or a smaller batch size (trainer.batch_size)"
    )


def _start_run(host: Host, cfg: FitConfig, plan: RunPlan, has_valid: bool = False) -> None:
    runtime, st = host.runtime, host.state
    st.epochs, st.max_steps, st.global_batch_size = cfg.epochs, cfg.max_steps, cfg.batch_size
    st.window_loss.reset()  # a fit's first record covers its own steps (a resume loads its window after)
    st.batches_per_epoch, st.history, st.stop_training, st.stop_reason = (
        plan.budget.batches_per_epoch,
        {},
        False,
        "",
    )
    assert runtime.module is not None
    st.info.model_name = type(runtime.module).__name__
    st.info.parameters, st.info.trainable_parameters = runtime.parameters, runtime.trainable_parameters
    st.info.strategy, st.info.world_size = runtime.strategy.describe(), runtime.world_size
    st.info.device_type, st.info.deepspeed_config = runtime.device.type, dict(runtime.config or {})
    warmup = warmup_note(host.scheduler_spec, plan.budget.total_steps) if host.scheduler_spec else None
    st.info.notes = [*plan.budget.notes, *([warmup] if warmup else []), *_past_the_end(cfg, plan, has_valid)]


def _past_the_end(cfg: FitConfig, plan: RunPlan, has_valid: bool) -> list[str]:
    """A validation or save frequency the run ends before reaching, one line each."""
    notes = []
    if has_valid and cfg.valid_freq > cfg.epochs:
        notes.append(
            f"valid_freq={cfg.valid_freq} is past the run's {cfg.epochs} epoch(s): no validation runs "
            f"(trainer.valid_freq={cfg.epochs} validates at the end)"
        )
    total = plan.budget.total_steps
    if cfg.save_dir is not None and cfg.save_freq > total:
        notes.append(
            f"save_freq={cfg.save_freq} is past the run's {total} optimizer steps: only the final checkpoint "
            "is written (trainer.checkpoint.save_freq)"
        )
    return notes


def _fit_callbacks(
    host: Host, cfg: FitConfig, parts: checkpoint.Stateful, extra: Iterable[Callback], resumed: bool
) -> CallbackList:
    """This fit's callbacks: the engine's, the call's, then the checkpoint manager (last, so a
    checkpoint includes this step's records); their `Control`."""
    main = host.runtime.process.is_main  # loggers write from rank 0 alone, from the API as from the CLI
    events = CallbackList(c for c in [*host.callbacks.callbacks, *extra] if main or not c.rank_zero_only)
    shown = any(isinstance(c, ConsoleLogger) for c in events.callbacks)
    if cfg.progress and host.runtime.process.is_main and not shown:
        events.extend(
            [ConsoleLogger()]
        )  # Engine.fit shows what the CLI shows (Paddle and Lightning print too)
    manager = None
    if cfg.save_dir is not None:
        manager = checkpoint.CheckpointManager(
            parts,
            cfg.save_dir,
            cfg.save_freq,
            cfg.keep_last_k,
            cfg.handle_preemption,
            on_saved=lambda: events.fire(Event.CHECKPOINT_SAVED, host.state),
            grace_s=cfg.preemption_grace_s,
        )
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
    batch_size = rows_per_batch(host, cfg.valid_batch_size or cfg.batch_size)
    val = {
        f"val_{k}": v
        for k, v in evaluate(host, valid_data, batch_size, cfg.valid_steps, cfg.collate_fn).items()
    }
    host.state.logs = {**(logs or {}), **val}
    if history_prefix is not None:
        for key, value in val.items():
            host.state.history[f"{history_prefix}{key}"] = [value]
    events.fire(Event.VALIDATION_END, host.state)
    return val


def _restore_position(loader: Any, st: LoopState) -> None:
    """Put the loader where the checkpoint's step left it: its saved state (same world size; a
    stream's on any), or the same global sample skipped to (another world size)."""
    if st.loader_state is not None:
        loader.load_state_dict(st.loader_state)
        return
    if isinstance(loader, StreamLoader):
        raise CheckpointError(
            "the checkpoint holds no position in this stream (it was saved by map-style data)"
        )
    skipped = st.batches_in_epoch
    state = loader.state_dict()
    state.update(
        _sampler_iter_state={"samples_yielded": skipped * loader.batch_size},
        _sampler_iter_yielded=skipped,
        _num_yielded=skipped,
    )
    loader.load_state_dict(state)
