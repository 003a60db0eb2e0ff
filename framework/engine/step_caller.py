"""The step an epoch calls, as a zero-argument call on the epoch's batches: the pipeline's, a
custom step's, or a step whose loss averages over the items of its whole global batch (the
framework's own, a method with `items`), each micro-batch weighted by its share
(`framework.engine.items`). `framework.engine.epoch` calls it until the epoch ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from framework.data import loaders as data_lib
from framework.engine.evaluation import Host
from framework.engine.items import StepWeights, counted_windows, window_weights
from framework.engine.steps import bind_step, counter_of, default_train_step

# Micro-batches whose items the framework's step counts in one all-reduce, on the CPU.
COUNT_AHEAD = 16


def train_step_caller(host: Host, batches: data_lib.BatchIterator, stream: bool = False) -> Callable[[], Any]:
    """A zero-argument call of the host's step flavour on `batches`: the pipeline's, a custom
    step's, or a step whose loss averages over counted items (the framework's own, a method
    with `items`), which gets each micro-batch's weight (`framework.engine.items`)."""
    if host.runtime.strategy.uses_pipeline:
        return lambda: {"loss": host.runtime.train_batch(batches)}
    rt = host.runtime
    device = rt.process.collective_device
    step = host.train_step_fn
    if step is None:

        def count_default(steps: list[list[Any]]) -> list[StepWeights] | None:
            return window_weights(steps, host.loss, host.module, host.label_key, rt.mesh, device)

        return CountedStep(host, batches, stream, functools.partial(default_train_step, host), count_default)
    items = counter_of(step)
    if items is None:
        call = bind_step(step)
        return lambda: call(host, batches)

    def count_items(steps: list[list[Any]]) -> list[StepWeights] | None:
        return counted_windows(steps, items, rt.mesh, device=device)

    def run(batch: Any, weight: Any) -> Any:  # a method gets its weight as a tensor (or None)
        return step(host, batch, weight() if callable(weight) else weight)

    return CountedStep(host, batches, stream, run, count_items)


class CountedStep:
    """A step of one micro-batch per call, each weighted by its share of its optimizer step's
    items (`framework.engine.items`): the framework's own, or a method's with `items`. On the
    CPU the items of several optimizer steps ahead (`COUNT_AHEAD` micro-batches) are counted in
    one all-reduce: a gloo collective costs each rank ~0.3 ms of host time whatever it carries,
    as much as the rest of the step's bookkeeping (`benchmarks.exactness`). On CUDA the count's
    all-reduce is queued on the device and the host never waits for it, so each step counts its
    own. Over a stream, whose ranks may reach its end at different steps, each step counts its
    own too."""

    def __init__(
        self,
        host: Host,
        batches: data_lib.BatchIterator,
        stream: bool,
        run: Callable[[Any, Any], Any],
        count: Callable[[list[list[Any]]], list[StepWeights] | None],
    ):
        self.host, self.batches, self.run, self.count = host, batches, run, count
        rt = host.runtime
        self.acc = rt.strategy.accumulation_steps
        self.steps_ahead = 1 if rt.process.cuda or stream else max(1, COUNT_AHEAD // self.acc)
        self.weights: list[Any] = []  # the counted micro-batches' weights still to use, in order
        self.windows: list[StepWeights] = []
        self.steps: list[StepWeights | None] = []  # the optimizer step of each weight in `weights`
        self.counted: StepWeights | None = None  # the step of the last micro-batch run

    def __call__(self) -> Any:
        if not self.weights:  # an optimizer step begins: count the items of its global batch (and more)
            self._count()
        self.counted = self.steps.pop(0) if self.steps else None
        return self.run(next(self.batches), self.weights.pop(0))

    def _count(self) -> None:
        ahead = self.batches.peek_many(self.acc * self.steps_ahead)
        steps = [ahead[i : i + self.acc] for i in range(0, len(ahead), self.acc)] or [[]]
        found = self.count(steps)
        self.windows = found or []
        for i, step in enumerate(steps):
            self.weights.extend(found[i].weight(j) if found else None for j in range(len(step)))
            self.steps.extend((found[i] if found else None) for _ in step)
        if not self.weights:
            self.weights.append(None)  # no batch left: the step's next() ends the epoch

    def close(self) -> None:
        """Finish a count still in flight (the epoch ended before its steps ran)."""
        for weights in self.windows:
            weights.settle()
