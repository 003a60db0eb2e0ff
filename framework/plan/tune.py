"""Autotune on paper: the layouts a search may try, which the cost model rules out, and which
measured one wins. Nothing here runs a step (`framework.engine.autotune` measures the trials,
`framework.cli.autotune` starts them from a config).

A *layout* is how a global batch is laid out over the ranks, never what is trained: the ZeRO
stage, optimizer offload, the accumulation steps (micro-batch = global batch / (data-parallel
ranks x accumulation), so the global batch stays fixed), activation recompute and the
tensor-parallel degree. Layout invariance (a tested guarantee) makes every layout train the same
numbers, so a search may pick any of them.

The search, in order:

1. `candidates`: every combination of the knobs in the space that applies to the model and the
   processes (offload only where there is a device to offload from, recompute only for a model
   with blocks, tensor parallelism only for a model with a plan and a degree that divides its
   heads and the processes, accumulation only where the batch divides).
2. `prune`: a layout whose estimated per-rank peak of model states (`framework.plan.cost`) is
   over budget x margin is not tried (the estimate leaves activations out: it is a floor).
3. Trials, simplest layout first (`Layout.simplicity`). A layout that turns every knob at least
   as far towards saving memory as one that was measured to fit, with the same tensor-parallel
   degree, is skipped: it saves memory the run does not need, and none of those knobs makes a
   step faster (offload and recompute add work, a higher stage adds communication, a smaller
   micro-batch gives the device less to do at once). So the search walks the frontier of what
   just fits instead of the whole grid. `exhaustive` tries every layout instead, smallest
   estimate first, skipping only those that hold at least what a layout measured over budget
   held (`needs_more`).
4. `choose`: the fastest measured layout whose peak is within budget x margin; layouts within
   `TIE` of the fastest count as equally fast, and the simplest of them wins.

`framework.plan.paper` ranks layouts for a cluster that is not here (a device count and memory
per device) from the cost model alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from framework.errors import ConfigError
from framework.plan.cost import model_state_bytes
from framework.plan.layouts import (  # noqa: F401 - the search's vocabulary, used by name from here
    ACCUMULATION,
    GB,
    KNOBS,
    TIE,
    Layout,
    ModelFacts,
    Trial,
    needs_more,
)
from framework.plan.run_plan import batch_layout
from framework.plan.strategy import Strategy


def _allowed_space(space: Iterable[str]) -> set[str]:
    chosen = {str(knob) for knob in space}
    unknown = sorted(chosen - set(KNOBS))
    if unknown:
        raise ConfigError(f"autotune.space: unknown knob(s) {unknown}; choose from {', '.join(KNOBS)}")
    return chosen


def check_searchable(base: Strategy) -> None:
    """One line when `base` is a strategy whose layouts autotune does not search (the pipeline's):
    said before anything else is asked of it (what tensor parallelism would split, say)."""
    if base.uses_pipeline:
        raise ConfigError(
            "autotune: the pipeline engine's layout (stages x micro-batches) is not searched; "
            "drop strategy.pipeline or tune without it"
        )


def candidates(
    base: Strategy,
    facts: ModelFacts,
    world_size: int,
    global_batch: int,
    space: Iterable[str] = KNOBS,
    offload_possible: bool = False,
) -> list[Layout]:
    """Every layout of `space` that applies (see the module doc), `base`'s own values for the
    knobs left out; the batch divides under each."""
    chosen = _allowed_space(space)
    check_searchable(base)
    now = Layout.of(base)
    model_parallel = base.sequence_parallel.degree > 1 or base.expert_parallel.degree > 1
    tp_options = tuple(d for d in facts.tp_degrees if world_size % d == 0)
    values: dict[str, tuple[Any, ...]] = {
        "stage": (0, 1, 2, 3) if "stage" in chosen else (now.stage,),
        "offload": (False, True) if "offload" in chosen and offload_possible else (now.offload,),
        "recompute": (False, True) if "recompute" in chosen and facts.recomputable else (now.recompute,),
        "tensor_parallel": tp_options
        if "tensor_parallel" in chosen and not model_parallel
        else (now.tensor_parallel,),
    }
    out = []
    for stage, offload, recompute, tp in itertools.product(
        values["stage"], values["offload"], values["recompute"], values["tensor_parallel"]
    ):
        if offload and stage == 0:
            continue
        for acc in ACCUMULATION if "micro_batch" in chosen else (now.accumulation,):
            layout = Layout(stage, offload, acc, recompute, tp)
            if _lays_out(layout, base, world_size, global_batch):
                out.append(layout)
    return out


def _lays_out(layout: Layout, base: Strategy, world_size: int, global_batch: int) -> bool:
    try:
        batch_layout(layout.apply(base), global_batch, world_size)
    except ConfigError:
        return False
    return True


def micro_batch(layout: Layout, base: Strategy, world_size: int, global_batch: int) -> int:
    """The per-rank micro-batch of `layout` for `global_batch` over `world_size` processes."""
    return batch_layout(layout.apply(base), global_batch, world_size).micro_batch_size


def estimated_bytes(strategy: Strategy, facts: ModelFacts, world_size: int) -> int:
    """The per-rank peak of model states on the device under `strategy` (`framework.plan.cost`)."""
    return model_state_bytes(
        strategy,
        facts.parameters,
        facts.largest_parameter,
        world_size,
        facts.optimizer_bytes_per_param,
        facts.tp_split,
        facts.ep_split,
    )["peak_bytes"]


def trials_for(
    layouts: Sequence[Layout], base: Strategy, facts: ModelFacts, world_size: int, global_batch: int
) -> list[Trial]:
    """One pending trial per layout, with its estimate, smallest estimate first (ties: simpler)."""
    out = [
        Trial(
            layout,
            micro_batch(layout, base, world_size, global_batch),
            estimated_bytes(layout.apply(base), facts, world_size) / GB,
        )
        for layout in layouts
    ]
    return sorted(out, key=lambda t: (round(t.estimated_gb, 6), t.layout.simplicity))


def prune(trials: Sequence[Trial], budget_gb: float, margin: float) -> None:
    """Mark the trials whose estimate is over `budget_gb` x `margin` as pruned (with why)."""
    limit = budget_gb * margin
    for trial in trials:
        if trial.status == "pending" and trial.estimated_gb > limit:
            trial.status = f"pruned: estimated {trial.estimated_gb:.3g} GB > {limit:.3g} GB (budget x margin)"


def skip_dominated(trial: Trial, done: Sequence[Trial], exhaustive: bool = False) -> bool:
    """Mark `trial` skipped (see the module doc, step 3) when it holds at least what a measured
    trial over budget held, or (unless `exhaustive`) saves memory in every knob against a measured
    trial that fits, at the same tensor-parallel degree; True when it was."""
    for other in done:
        if other.status.startswith("over budget") and needs_more(trial.layout, other.layout):
            trial.status = f"skipped: holds at least what {other.name} holds, which was over budget"
            return True
        same_tp = other.layout.tensor_parallel == trial.layout.tensor_parallel
        if not exhaustive and other.fits and same_tp and needs_more(other.layout, trial.layout):
            trial.status = f"skipped: saves more memory than {other.name}, which fits (no faster)"
            return True
    return False


def record(
    trial: Trial, peak_gb: float | None, samples_per_s: float | None, error: str | None, limit_gb: float
) -> None:
    """What a trial measured (or why it failed): fits when its peak is within `limit_gb`."""
    if error is not None:
        out_of_memory = "out of memory" in error.lower() or "MemoryError" in error
        trial.status = f"over budget: {error}" if out_of_memory else f"failed: {error}"
        return
    trial.peak_gb, trial.samples_per_s = peak_gb, samples_per_s
    trial.fits = peak_gb is not None and peak_gb <= limit_gb
    trial.status = "ok" if trial.fits else "over budget"


def choose(trials: Sequence[Trial]) -> Trial | None:
    """The fastest trial that fits (within `TIE` of it: the simplest), or None."""
    fitting = [t for t in trials if t.fits and t.samples_per_s]
    if not fitting:
        return None
    best = max(t.samples_per_s or 0.0 for t in fitting)
    close = [t for t in fitting if (t.samples_per_s or 0.0) >= best * (1 - TIE)]
    return min(close, key=lambda t: t.layout.simplicity)


def nothing_fits(
    trials: Sequence[Trial], budget_gb: float, margin: float, offload_possible: bool
) -> ConfigError:
    """The one-line error of a budget no layout fits: the smallest need, and what would get there."""
    measured = [t.peak_gb for t in trials if t.peak_gb is not None]
    smallest = min(trials, key=lambda t: t.estimated_gb) if trials else None
    need = (
        f"the smallest estimated need is {smallest.estimated_gb:.3g} GB per rank ({smallest.name})"
        if smallest
        else "no layout applies"
    )
    if measured:
        need += f", the smallest measured peak {min(measured):.3g} GB"
    ways = ["more ranks (trainer.devices, or more nodes)"]
    ways.append(
        "optimizer offload (autotune.space with offload)" if offload_possible else "a device to offload to"
    )
    ways.append("a smaller global batch (trainer.batch_size)")
    return ConfigError(
        f"autotune: no layout fits {budget_gb:.3g} GB per rank (x {margin:g} margin): {need}; "
        f"{', '.join(ways)} would get closer"
    )


def _cell(value: float | None, digits: str) -> str:
    width = int(digits.split(".")[0])
    return "-".rjust(width) if value is None else format(value, digits)


def table_header() -> str:
    return f"{'layout':<38} {'est GB':>8} {'peak GB':>8} {'samples/s':>10}  status"


def table_row(trial: Trial) -> str:
    """One line of the console table (a trial as it finishes)."""
    return (
        f"{trial.name:<38} {_cell(trial.estimated_gb, '8.3f')} {_cell(trial.peak_gb, '8.3f')} "
        f"{_cell(trial.samples_per_s, '10.1f')}  {trial.status}"
    )


def report(
    budget_gb: float, margin: float, chosen: Trial | None, trials: Sequence[Trial], **extra: Any
) -> dict[str, Any]:
    """`autotune.json`: the budget, the chosen layout and every trial."""
    picked = None
    if chosen is not None:
        picked = {k: chosen.row()[k] for k in ("layout", "overrides", "peak_gb", "samples_per_s")}
    return {
        "budget_gb": budget_gb,
        "margin": margin,
        "chosen": picked,
        "trials": [t.row() for t in trials],
        **extra,
    }


def run_search(
    trials: list[Trial],
    budget_gb: float,
    margin: float,
    measure: Callable[[Trial], tuple[float | None, float | None, str | None]],
    show: Callable[[str], None] = print,
    exhaustive: bool = False,
) -> Trial | None:
    """Prune, try the remaining trials (`measure` returns peak GB, samples/s, error) in the order
    of the module doc, print each row as it finishes (skipped ones as one line per reason);
    `trials` is left in that order. The chosen trial or None."""
    prune(trials, budget_gb, margin)
    if not exhaustive:
        trials.sort(key=lambda t: t.layout.simplicity)
    show(table_header())
    done: list[Trial] = []
    skipped: dict[str, int] = {}
    for trial in trials:
        if trial.status == "pending" and not skip_dominated(trial, done, exhaustive):
            record(trial, *measure(trial), limit_gb=budget_gb * margin)
            done.append(trial)
        if trial.status.startswith("skipped: "):
            reason = trial.status.removeprefix("skipped: ")
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        show(table_row(trial))
    for reason, count in skipped.items():
        show(f"  {count} layout(s) skipped: {reason}")
    return choose(trials)
