"""Autotune, measured: a trial run of one layout (its peak memory per rank and its samples/s), and
`Engine.autotune`'s search over the layouts `framework.plan.tune` proposes.

A trial is `fit` for a few optimizer steps with nothing else on (no validation, no checkpoint, no
logging), its engine built inside the measured window: the model, DeepSpeed's states and buffers,
activations and the step's temporaries are all in the peak. Every rank runs the same trials in the
same order; each trial's result is agreed between them (the largest peak, the slowest rate).

`Engine.autotune` runs its trials in the engine's own processes, one after another (a Python
session cannot restart itself); the CLI starts a fresh worker group per trial instead
(`framework.cli.autotune`), where memory is as clean as it gets.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterable
from typing import Any

from framework.backend import deepspeed_globals
from framework.backend.estimate import model_facts
from framework.data.outputs import ModelLoss
from framework.errors import ConfigError
from framework.observe.probe import PeakMemory, StepClock
from framework.plan import tune
from framework.plan.strategy import Strategy
from framework.process.context import ProcessContext
from framework.process.environment import device_memory_bytes

TRIAL_STEPS = 6  # optimizer steps of a trial
WARMUP_STEPS = 2  # of which the first ones are not timed


def trial_options(batch_size: int, steps: int, **fit_options: Any) -> dict[str, Any]:
    """`fit`'s options for a trial: `steps` optimizer steps of `batch_size`, nothing else on."""
    return {
        **fit_options,
        "batch_size": batch_size,
        "max_steps": steps,
        "epochs": 1_000_000,  # max_steps ends it; a small dataset repeats
        "log_freq": steps + 1,
        "save_dir": None,
        "valid_at_start": False,
        "progress": False,
    }


def measure(
    make_engine: Callable[[Strategy], Any],
    strategy: Strategy,
    train_data: Any,
    options: dict[str, Any],
    process: ProcessContext,
    warmup: int = WARMUP_STEPS,
    catch: bool = True,
) -> tuple[float | None, float | None, str | None]:
    """(peak GB per rank, samples/s, error) of `fit(train_data, **options)` on the engine
    `make_engine(strategy)` builds (see the module doc); all ranks agree on each number. With
    `catch`, a trial that raises is an error, not a failure of the search (in a worker of its own,
    a trial lets it end the worker: the launcher then stops the other ranks at once)."""
    memory, clock = PeakMemory(process.cuda), StepClock(warmup, process.cuda)
    process.barrier()
    memory.reset()
    error = None
    trial = None
    try:
        trial = make_engine(strategy)
        trial.fit(train_data, callbacks=[clock], **options)
    except (
        ConfigError,
        RuntimeError,
        MemoryError,
        ValueError,
    ) as exc:  # torch's OutOfMemoryError is a RuntimeError
        if not catch:
            raise
        error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    peak = memory.peak_bytes()
    seconds = clock.seconds_per_step()
    if trial is not None:
        trial.close()
    del trial
    deepspeed_globals.forget_groups()  # the next trial's DeepSpeed builds its own groups
    gc.collect()
    results = process.all_gather_object((peak, seconds, error))
    errors = [e for _, _, e in results if e is not None]
    if errors:
        return None, None, errors[0]
    times = [s for _, s, _ in results]
    if any(s is None for s in times):
        return None, None, f"too few steps to time: autotune.trial_steps must be more than {warmup}"
    rate = int(options["batch_size"]) / max(times)  # type: ignore[type-var]
    return max(p for p, _, _ in results) / tune.GB, rate, None


def budget_gb(process: ProcessContext, memory_gb: float | None) -> float:
    """The per-rank budget: `memory_gb`, else the device's memory (`device_memory_bytes`)."""
    if memory_gb is not None:
        if not memory_gb > 0:
            raise ConfigError(f"autotune: memory_gb={memory_gb} must be a number > 0 (GB per rank)")
        return float(memory_gb)
    index = process.device_index if process.cuda else 0
    return device_memory_bytes(process.accelerator, index or 0, process.local_world_size) / tune.GB


def search(
    engine: Any,
    train_data: Any,
    batch_size: int,
    memory_gb: float | None = None,
    *,
    trial_steps: int = TRIAL_STEPS,
    warmup_steps: int = WARMUP_STEPS,
    space: Iterable[str] = tune.KNOBS,
    margin: float = 0.9,
    exhaustive: bool = False,
    **fit_options: Any,
) -> tuple[Strategy, list[dict[str, Any]]]:
    """`Engine.autotune`: the fastest layout of `batch_size` within `memory_gb` x `margin` per
    rank, by trials of `trial_steps` optimizer steps in this process (see the module doc), and the
    table of trials (`framework.plan.tune.Trial.row`). `space`: the knobs to vary
    (`framework.plan.tune.KNOBS`); `exhaustive`: try every layout, not only the frontier of what
    just fits; `fit_options`: `fit`'s (collate_fn, num_workers, shuffle, ...)."""
    if engine.runtime.ready:
        raise ConfigError("autotune before the engine is prepared: call it before prepare(), fit() or run()")
    process = engine.runtime.start()
    base, world = engine.strategy, process.world_size
    tune.check_searchable(base)
    limit = budget_gb(process, memory_gb)
    facts = model_facts(engine.module, base, engine.optimizer_spec, world)
    layouts = tune.candidates(base, facts, world, batch_size, space, offload_possible=process.cuda)
    trials = tune.trials_for(layouts, base, facts, world, batch_size)
    options = trial_options(batch_size, trial_steps, **fit_options)
    make = _copies_of(engine)
    show = print if process.is_main else (lambda line: None)

    def run(trial: tune.Trial) -> tuple[float | None, float | None, str | None]:
        return measure(make, trial.layout.apply(base), train_data, options, process, warmup_steps)

    chosen = tune.run_search(trials, limit, margin, run, show, exhaustive)
    if chosen is None:
        raise tune.nothing_fits(trials, limit, margin, offload_possible=process.cuda)
    show(
        f"autotune: {chosen.name} ({chosen.samples_per_s:.1f} samples/s, peak {chosen.peak_gb:.3g} GB of {limit:.3g} GB)"
    )
    return chosen.layout.apply(base), [t.row() for t in trials]


def _copies_of(engine: Any) -> Callable[[Strategy], Any]:
    """A factory of trial engines: `engine`'s model (a copy of its weights as they are now), loss,
    optimizer, scheduler and steps under another strategy, in the same processes."""
    loss: Any = "model" if isinstance(engine.loss, ModelLoss) else getattr(engine.loss, "fn", engine.loss)
    steps = {
        "train_step": engine.train_step_fn,
        "eval_step": engine.eval_step_fn,
    }
    own = getattr(engine.module, "training_step", None)
    if callable(own):
        steps["train_step"] = None  # the copy's own method, bound to the copy

    def make(strategy: Strategy) -> Any:
        return type(engine)(
            copy.deepcopy(engine.module),
            loss,
            engine.optimizer_spec,
            strategy=strategy,
            scheduler=engine.scheduler_spec,
            seed=engine.seed,
            prefetch=engine.prefetch,
            process=engine.process,
            label_key=engine.label_key,
            output_key=engine.output_key,
            **steps,
        )

    return make
