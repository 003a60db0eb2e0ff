"""One training epoch: call the step until the epoch's data (or its optimizer steps, or
`max_steps`) runs out, counting what the step really consumed; losses stay on the device and are
read at logging points. Functions of the `framework.engine.evaluation.Host` protocol (`loops.fit`
calls `train_epoch` once per epoch).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from typing import Any

from framework.data import loaders as data_lib
from framework.data.outputs import batch_size_of
from framework.data.stream_loader import StreamLoader
from framework.engine.evaluation import Host
from framework.engine.step_caller import CountedStep, train_step_caller
from framework.engine.steps import apply_train_result, owner
from framework.observe.callbacks import CallbackList, Event, may_stop_alone
from framework.observe.state import LoopState
from framework.observe.throughput import Speedometer
from framework.plan.run_plan import Budget
from framework.process import watchdog
from framework.process.context import ProcessContext

# A step that pulls no batch this many times in a row would never end an epoch.
MAX_IDLE_CALLS = 10_000
# A pass that leaves more than this share of a stream's source untrained says so at its end.
LEFT_SHARE = 0.02


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

    data = _EpochData(host, loader, budget, events.agree_each_step)
    batches = data.batches
    step = train_step_caller(host, batches, data.stream)
    # A middle pipeline stage pulls no data, so every rank counts train_batch calls instead.
    pipeline_calls = budget.steps_per_epoch if runtime.strategy.uses_pipeline else None
    pending: list[Any] = []  # losses of the optimizer step in progress (dropped if fp16 skips it)
    idle_calls = 0
    try:
        while not data.pass_over(st, pipeline_calls, budget.steps_per_epoch):
            fetched, boundaries, skipped = batches.fetched, runtime.global_steps, runtime.skipped_steps
            if speed is not None and not speed.measured and batches.peek() is not None:
                speed.measure(batches.peek(), st.global_step)  # once, on the first batch
            events.fire(Event.STEP_START, st)
            runtime.grad_norm_wanted = (st.global_step + 1) % max(1, log_freq) == 0  # ZeRO-0 computes it then
            try:
                with speed.counting() if speed is not None else contextlib.nullcontext():
                    loss = data.call(host, step, speed)
            except StopIteration:
                _cut_short(host, events, pending, boundaries, skipped, log_freq, speed)
                break
            st.step_calls += 1
            if loss is not None:
                pending.append(loss)
            _after_step(host, pending, boundaries, skipped, log_freq, speed)
            if st.log_now and isinstance(step, CountedStep) and step.counted is not None:
                st.logs["counted_items"] = step.counted.items()  # e.g. the tokens the loss counted
            data.need = max(data.need, batches.fetched - fetched)
            idle_calls = idle_calls + 1 if batches.fetched == fetched and pipeline_calls is None else 0
            if idle_calls >= MAX_IDLE_CALLS:
                raise RuntimeError(f"the training step pulled no batch in {MAX_IDLE_CALLS} consecutive calls")
            events.fire(Event.STEP_END, st)
    finally:
        if isinstance(step, CountedStep):
            step.close()
        data.source.close()
    if isinstance(loader, StreamLoader):
        data.report_left(loader)
    return _epoch_logs(host, pending, with_loss=not data.report_skipped(st, step))


class _EpochData:
    """This epoch's batches as a step pulls them: prefetched onto the device, each counted into
    the loop state with the loader position after it; over a stream, the ranks' agreement on
    where the pass ends."""

    def __init__(self, host: Host, loader: Any, budget: Budget, agree_each_step: bool = True):
        st, runtime = host.state, host.runtime
        self.stream, self.runtime = isinstance(loader, StreamLoader), runtime
        self.agree_each_step = agree_each_step  # a stop may be asked on some ranks only
        self.ran_out = False  # the pass ended because the stream did (on some rank)
        self.skipped = 0  # batches the step skipped on this rank (returned None, no backward pass)
        self.need = runtime.strategy.accumulation_steps  # batches of the next optimizer step (or step call)

        def on_fetch(batch: Any) -> None:
            st.batches_in_epoch += 1
            st.batches_fetched += 1
            st.samples_seen += batch_size_of(batch) * runtime.dp_size
            st.loader_state = self.batches.snapshot

        self.source = data_lib.Prefetcher(
            iter(loader), runtime.copier, host.prefetch, snapshot=loader.state_dict
        )
        limit = _batch_limit(host, None if self.stream else len(loader), budget)
        left = None if limit is None else limit - st.batches_in_epoch
        self.batches = data_lib.BatchIterator(self.source, on_fetch, left)

    def call(self, host: Host, step: Callable[[], Any], speed: Speedometer | None) -> Any:
        """Call the step once and act on its result; its loss, still on the device. A call that
        returned None and ran no backward pass skipped its batches (Lightning's way to skip one)."""
        backwards, fetched = self.runtime.backward_calls, self.batches.fetched
        result = _timed(step, self.batches, speed)
        if result is None and self.runtime.backward_calls == backwards:
            self.skipped += self.batches.fetched - fetched
        return apply_train_result(host, result)

    def report_skipped(self, st: LoopState, step: Any) -> bool:
        """The batches a step of the user's skipped this epoch, summed over the data-parallel
        ranks into `st.skipped_batches` (every rank takes part); the first epoch that skipped some
        and trained says so on rank 0, one line. True when the step skipped every batch."""
        if isinstance(step, CountedStep) or self.runtime.strategy.uses_pipeline:  # the framework's steps
            return False
        process, mp = self.runtime.process, self.runtime.mesh.mp_size
        counts = process.all_gather_object((self.skipped, self.batches.fetched))
        skipped, fetched = (sum(c[i] for c in counts) // mp for i in (0, 1))
        if skipped and not st.skipped_batches and st.global_step and process.is_main:
            print(
                f"warning: the training step skipped {skipped:,} of the {fetched:,} batches of epoch {st.epoch + 1} "
                "(it returned None): nothing was trained on them, and the logged loss leaves them out",
                file=sys.stderr,
                flush=True,
            )
        st.skipped_batches += skipped
        return bool(skipped) and skipped == fetched

    def pass_over(self, st: LoopState, pipeline_calls: int | None, steps_per_epoch: int | None) -> bool:
        """True when the pass has no step left: its budget spent (`_budget_over`), no batch left,
        or training stopped. At each optimizer-step boundary the ranks decide together, in one
        collective: training stops everywhere when it stops on one rank (`agree_stop`, where a
        stop may be asked on some ranks only: `CallbackList.agree_each_step`), and over a
        stream, whose ranks may run out at different steps, the pass goes on only when every rank
        has the next step's batches (a custom step may pull more: as many as it did)."""
        budget_over = _budget_over(st, pipeline_calls, steps_per_epoch)
        over = st.stop_training or budget_over or (pipeline_calls is None and self.batches.exhausted())
        if not self.runtime.at_step_boundary():
            return over
        if not self.stream:  # the data ends every rank's pass at the same step; a stop need not
            return (self.agree_each_step and agree_stop(st, self.runtime.process)) or over
        short = len(self.batches.peek_many(self.need)) < self.need
        stop, end = self.runtime.process.agree(st.stop_training, over or short)
        _stopped_elsewhere(st, stop)
        self.ran_out = end and not stop and not budget_over
        return stop or end

    def report_left(self, loader: StreamLoader) -> None:
        """At the end of a pass the stream ended (every rank takes part): how much of the source
        the pass left untrained, when that is over `LEFT_SHARE` (a pass ends at its first empty
        global slot, so shards of very different lengths leave the longer ones' tails)."""
        if not self.ran_out:
            return
        process = self.runtime.process
        total = -process.all_reduce_min(-(loader.total if loader.total is not None else -1))
        if total <= 0:
            return
        left = round(process.all_reduce_mean(loader.left_behind(total)) * process.world_size)
        if left > LEFT_SHARE * total and process.is_main:
            print(
                f"warning: this pass ended at its shortest shard's end and left {left:,} of {total:,} "
                f"examples ({100 * left / total:.0f} %) untrained; shuffle (data.shuffle_window) or fewer "
                "shards (data.dataset.shards) balance the shards",
                file=sys.stderr,
                flush=True,
            )


def _cut_short(
    host: Host,
    events: CallbackList,
    pending: list[Any],
    boundaries: int,
    skipped: int,
    log_freq: int,
    speed: Speedometer | None,
) -> None:
    """A step the end of the data cut short (StopIteration): the optimizer steps it took count,
    the gradients of backward passes no step closed are dropped (the next epoch starts clean)."""
    host.runtime.discard_open_step()
    _after_step(host, pending, boundaries, skipped, log_freq, speed)
    if host.runtime.global_steps > boundaries:
        events.fire(Event.STEP_END, host.state)


def _epoch_logs(host: Host, pending: list[Any], with_loss: bool = True) -> dict[str, Any]:
    """The epoch's mean loss over all ranks (none when the step skipped every batch: never a
    0.0 that no batch gave), lr and training metrics; NaN/inf since the last logging point stops
    training here."""
    st = host.state
    for loss in pending:  # an accumulation the epoch ended in the middle of
        st.window_loss.add(loss, st.global_step)
        st.epoch_loss.add(loss, st.global_step)
    _reduced_window_loss(st, host.runtime.process, keep=True)  # the next record's window goes on
    mean = host.runtime.process.all_reduce_mean
    loss = mean(st.epoch_loss.mean())
    logs: dict[str, Any] = {"loss": loss, "lr": host.runtime.lr} if with_loss else {"lr": host.runtime.lr}
    logs.update(host.metrics.train.compute())
    return logs


def agree_each_step(host: Host, events: CallbackList) -> bool:
    """Whether the ranks must agree on stopping at every optimizer step: a callback may ask a
    stop between steps on some ranks only (`callbacks.may_stop_alone`), or the training step is
    the user's own (it gets the engine, and its state). Decided by every rank together, once:
    callbacks that run on rank 0 alone are in rank 0's list only."""
    step = host.train_step_fn
    mine = (step is not None and not getattr(step, "stops_alike", False)) or any(
        may_stop_alone(c) for c in events.callbacks
    )
    return host.runtime.process.any_rank(mine)


def agree_stop(st: LoopState, process: Any) -> bool:
    """Whether training stops, agreed by every rank in one collective (a stop is not always asked
    on every rank: a callback on a wall-clock budget or a rank's own values asks on one; the
    others would wait in the next step's collectives until `trainer.timeout_s`)."""
    stop, _ = process.agree(st.stop_training, False)
    _stopped_elsewhere(st, stop)
    return stop


def _stopped_elsewhere(st: LoopState, stop: bool) -> None:
    if stop and not st.stop_training:
        st.stop_training, st.stop_reason = True, "training stopped on another rank"


def _batch_limit(host: Host, loader_batches: int | None, budget: Budget) -> int | None:
    """Micro-batches this epoch may hand out: the budget's for the framework's steps; for a
    custom step, which may pull any number per optimizer step, whole accumulations of the
    loader (the epoch's optimizer steps are capped by `_budget_over`). None: a stream's end."""
    if host.train_step_fn is None or host.runtime.strategy.uses_pipeline or loader_batches is None:
        return budget.batches_per_epoch
    acc = host.runtime.strategy.accumulation_steps
    return loader_batches // acc * acc


def _budget_over(st: LoopState, pipeline_calls: int | None, steps_per_epoch: int | None) -> bool:
    """True when this epoch's step budget is spent (the same on every rank): max_steps reached,
    its optimizer steps taken (a pipeline: its calls done, since a middle stage pulls no data)."""
    if st.max_steps is not None and st.global_step >= st.max_steps:
        st.stop_training, st.stop_reason = True, f"reached trainer.max_steps={st.max_steps}"
        return True
    if steps_per_epoch is not None and st.steps_in_epoch >= steps_per_epoch:
        return True
    return pipeline_calls is not None and st.step_calls >= pipeline_calls


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
    read_samples = getattr(host.train_step_fn, "step_samples", None)
    st.samples = read_samples() if callable(read_samples) else []
    st.logs = {"batches": st.batches_in_epoch, "lr": runtime.lr}
    if st.log_now:
        st.logs["loss"] = _reduced_window_loss(st, runtime.process)
        norm = runtime.grad_norm  # of the gradients the last optimizer step received
        if norm is not None:
            st.logs["grad_norm"] = norm
        if st.skipped_steps:
            st.logs["skipped_steps"] = st.skipped_steps
        if speed is not None:
            st.logs.update(speed.logs(st.global_step))
        st.logs.update(_objective_logs(host))


def _objective_logs(host: Host) -> dict[str, Any]:
    """What a training step object measures over the steps since the last logging point (its
    `step_logs(device)`, e.g. DPO's rewards), reduced over ranks: collective, every rank logs."""
    read = getattr(owner(host.train_step_fn), "step_logs", None)
    return read(host.runtime.process.collective_device) if callable(read) else {}


def _reduced_window_loss(st: LoopState, process: ProcessContext, keep: bool = False) -> float:
    """The mean loss since the last logging point over all ranks (one device read), across epoch
    ends, as HF and TRL log it (`keep`: the window goes on, at an epoch's end); NaN/inf there
    raises NonFiniteLoss on every rank, naming the first step it appeared at."""
    bad = st.first_bad_loss()
    value = process.all_reduce_mean(st.window_loss.mean())
    if not keep:
        st.window_loss.reset()
    if bad is not None or not math.isfinite(value):
        step = process.all_reduce_min(bad[0] if bad else st.global_step)
        raise st.non_finite_error(step, bad[1] if bad else value)
    return value
