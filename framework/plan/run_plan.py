"""The run plan: every number of a training run, computed once, before anything is built.

    mesh      world = data-parallel x tensor-parallel x sequence-parallel ranks (x pipeline
              stages); experts split inside the data-parallel ranks; this rank's coordinates
    layout    global batch = micro x accumulation x data-parallel ranks
    budget    micro-batches per epoch (whole optimizer steps only), optimizer steps per epoch
              and in total (epochs, data length, `steps_per_epoch`, `max_steps`)
    resume    the checkpoint to continue, and whether it needs DeepSpeed's universal loader

Learned from torchtitan's trainer (numbers first, then the parts built from them with explicit
arguments). `Runtime` builds DeepSpeed from the mesh and layout; the loop, the data, the
scheduler and the checkpoint read the budget; nobody re-derives a number. Evaluation and
prediction need only the mesh, so calling them first never freezes a training number.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from framework.errors import ConfigError
from framework.plan.strategy import Strategy

# Parameter names under which a scheduler factory receives the run's optimizer-step budget
# (ours, and Hugging Face's `get_*_schedule_with_warmup`).
BUDGET_PARAMETERS = ("total_steps", "num_training_steps")


@dataclass(frozen=True)
class Mesh:
    """The ranks of a job: `world_size` = `dp_size` data-parallel replicas x `tp_size` tensor-
    parallel x `sp_size` sequence-parallel ranks, or x `pipeline_stages` (the pipeline takes no
    model parallelism). `ep_size` splits experts inside the data-parallel ranks.

    Rank order follows DeepSpeed's groups: model-parallel ranks are neighbours (rank = dp_rank x
    (tp x sp) + mp_rank); pipeline stages are the outer dimension (rank = stage x dp + dp_rank).
    The ranks of one data-parallel replica see the same batch (TP), or slices of it (SP)."""

    world_size: int
    rank: int
    pipeline_stages: int = 1
    tp_size: int = 1
    sp_size: int = 1
    ep_size: int = 1

    @property
    def mp_size(self) -> int:
        """Model-parallel ranks per data-parallel replica (tensor x sequence parallel)."""
        return self.tp_size * self.sp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: the replicas a global batch is split over."""
        return self.world_size // (self.pipeline_stages * self.mp_size)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas."""
        if self.pipeline_stages > 1:
            return self.rank % self.dp_size
        return self.rank // self.mp_size

    @property
    def mp_rank(self) -> int:
        """This rank's index inside its replica's tensor- or sequence-parallel group."""
        return self.rank % self.mp_size if self.pipeline_stages == 1 else 0

    @property
    def sp_rank(self) -> int:
        """Which slice of each sequence this rank holds (0 without sequence parallelism)."""
        return self.mp_rank if self.sp_size > 1 else 0

    def describe(self) -> str:
        """One line: "4 ranks = 2 data-parallel x 2 tensor-parallel"."""
        parts = [f"{self.dp_size} data-parallel"]
        for name, size in (("tensor", self.tp_size), ("sequence", self.sp_size)):
            if size > 1:
                parts.append(f"{size} {name}-parallel")
        if self.pipeline_stages > 1:
            parts.append(f"{self.pipeline_stages} pipeline stages")
        line = f"{self.world_size} rank(s) = {' x '.join(parts)}"
        return line + (f"; experts over {self.ep_size} ranks" if self.ep_size > 1 else "")


def mesh_of(strategy: Strategy, world_size: int, rank: int = 0) -> Mesh:
    """The mesh of `world_size` processes under `strategy`, or a one-line error when the degrees
    do not divide it. The one place the data-parallel degree is derived."""
    stages = strategy.pipeline.stages
    if world_size % stages != 0:
        raise ConfigError(
            f"strategy.pipeline.stages={stages} does not divide the {world_size} processes; "
            f"use a process count that is a multiple of {stages} (e.g. trainer.devices={stages})"
        )
    tp, sp, ep = (
        strategy.tensor_parallel.degree,
        strategy.sequence_parallel.degree,
        strategy.expert_parallel.degree,
    )
    mp = tp * sp
    if world_size % mp:
        name = "tensor_parallel" if tp > 1 else "sequence_parallel"
        raise ConfigError(
            f"strategy.{name}.degree={mp} does not divide the {world_size} processes; use a process count "
            f"that is a multiple of {mp} (e.g. trainer.devices={mp})"
        )
    if ep > 1 and world_size % ep:
        raise ConfigError(
            f"strategy.expert_parallel.degree={ep} does not divide the {world_size} processes; "
            f"use a process count that is a multiple of {ep} (e.g. trainer.devices={ep})"
        )
    return Mesh(world_size, rank, stages, tp, sp, ep)


@dataclass(frozen=True)
class BatchLayout:
    """How one global batch splits: global = micro x accumulation x data-parallel ranks."""

    global_batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    data_parallel_size: int


def batch_layout(strategy: Strategy, global_batch_size: int, world_size: int) -> BatchLayout:
    """Split a global training batch over ranks and accumulation steps, or say in words why it
    cannot. The one place the split is computed (`framework.backend.runtime` owns the result)."""
    dp = mesh_of(strategy, world_size).dp_size
    acc = strategy.accumulation_steps
    per = dp * acc
    if global_batch_size < 1 or global_batch_size % per != 0:
        lower = max(per, global_batch_size // per * per)
        raise ConfigError(
            f"global batch size {global_batch_size} does not divide over {dp} data-parallel rank(s) x "
            f"{acc} accumulation step(s) (= {per}); use a multiple of {per}, e.g. {lower} or {lower + per}"
        )
    micro = global_batch_size // per
    fixed = strategy.pipeline.micro_batch_size
    if strategy.uses_pipeline and fixed is not None and fixed != micro:
        raise ConfigError(
            f"strategy.pipeline.micro_batch_size={fixed} disagrees with global batch {global_batch_size} = "
            f"micro x {acc} accumulate_steps x {dp} data-parallel rank(s) (micro would be {micro}); "
            f"use a global batch of {fixed * per} or leave micro_batch_size unset"
        )
    return BatchLayout(global_batch_size, micro, acc, dp)


def eval_split(mesh: Mesh, global_batch_size: int) -> int:
    """This rank's share of an evaluation / prediction batch (no accumulation there)."""
    if global_batch_size < 1 or global_batch_size % mesh.dp_size:
        raise ConfigError(
            f"batch size {global_batch_size} does not divide over {mesh.dp_size} data-parallel ranks; "
            f"use a multiple of {mesh.dp_size}"
        )
    return global_batch_size // mesh.dp_size


@dataclass(frozen=True)
class Budget:
    """How long training runs, in this rank's micro-batches and in optimizer steps."""

    epochs: int
    batches_per_epoch: int | None  # micro-batches a rank takes per epoch: whole optimizer steps only
    steps_per_epoch: int | None  # optimizer steps per epoch (None: a stream's, until it ends)
    total_steps: int  # optimizer steps of the whole run (what a schedule decays over)
    max_steps: int | None = None
    notes: tuple[str, ...] = ()  # limits that disagree: which one wins, and the key to change


def _unreached_max_steps(epochs: int, steps: int, max_steps: int | None) -> tuple[str, ...]:
    """The line for a `max_steps` that the epochs end before (empty when they agree)."""
    if not max_steps or max_steps <= epochs * steps:
        return ()
    need = math.ceil(max_steps / steps)
    return (
        f"max_steps={max_steps} is not reached: {epochs} epoch(s) of {steps} optimizer steps end the run at "
        f"{epochs * steps}, and the schedule is planned for {epochs * steps} (epochs={need} reaches it: "
        f"trainer.epochs={need})",
    )


def step_budget(
    layout: BatchLayout,
    loader_batches: int,
    epochs: int,
    steps_per_epoch: int | None = None,
    max_steps: int | None = None,
    samples: int | None = None,
) -> Budget:
    """The budget of `epochs` epochs over a loader of `loader_batches` micro-batches per rank
    (of a data set of `samples`, when known: what an epoch leaves out is then said once).

    An epoch ends at an optimizer-step boundary: the micro-batches that cannot fill a whole
    accumulation at its end are left out (Paddle's choice; the next epoch starts a fresh step),
    so an epoch takes exactly `steps_per_epoch` optimizer steps and the schedule's length is
    the number of steps really taken. `steps_per_epoch` caps optimizer steps, whatever the step
    flavour."""
    acc = layout.accumulation_steps
    steps = loader_batches // acc
    notes = _left_out(layout, steps, samples, steps_per_epoch, max_steps)
    if steps_per_epoch is not None:
        steps = min(steps, steps_per_epoch)
    if steps < 1:
        raise ConfigError(
            f"an epoch has {loader_batches} micro-batch(es) per rank, fewer than the {acc} of one optimizer "
            "step: use a smaller batch size or fewer accumulation steps"
        )
    total = epochs * steps
    if max_steps:
        total = min(total, max_steps)
    notes += _unreached_max_steps(epochs, steps, max_steps)
    return Budget(epochs, steps * acc, steps, total, max_steps, notes)


def _left_out(
    layout: BatchLayout, steps: int, samples: int | None, steps_per_epoch: int | None, max_steps: int | None
) -> tuple[str, ...]:
    """The line for the samples each epoch leaves out because they do not fill a global batch
    (empty when none are, or when `steps_per_epoch` or `max_steps` end epochs sooner anyway)."""
    batch = layout.global_batch_size
    trained = steps * batch
    capped = (steps_per_epoch is not None and steps_per_epoch < steps) or (max_steps or steps) < steps
    if samples is None or trained >= samples or steps < 1 or capped:
        return ()
    return (
        f"an epoch trains {trained:,} of the {samples:,} samples: the last {samples - trained:,} of its order "
        f"do not fill a global batch of {batch} and are left out (a batch size that divides {samples:,} trains "
        "every one: trainer.batch_size)",
    )


def stream_budget(
    layout: BatchLayout, epochs: int, steps_per_epoch: int | None = None, max_steps: int | None = None
) -> Budget:
    """The budget over a stream, whose length is unknown: `max_steps` optimizer steps in all
    (the schedule's length), `steps_per_epoch` per pass (None: until the stream ends)."""
    if max_steps is None and steps_per_epoch is None:
        raise ConfigError(
            "the training data is a stream (it has no length): bound the run with max_steps "
            "(trainer.max_steps=N on the command line), or give steps_per_epoch"
        )
    total = min(max_steps or math.inf, epochs * (steps_per_epoch or math.inf))
    per = steps_per_epoch * layout.accumulation_steps if steps_per_epoch is not None else None
    if steps_per_epoch is not None:
        notes = _unreached_max_steps(epochs, steps_per_epoch, max_steps)
    else:  # the passes' length is known only at their end: the final line says which limit ended it
        notes = (
            f"a stream: the run ends at max_steps={max_steps} or after {epochs} pass(es) over the data, "
            "whichever comes first (trainer.epochs for more passes); the schedule is planned for "
            f"{max_steps} steps",
        )
    return Budget(epochs, per, steps_per_epoch, int(total), max_steps, notes)


@dataclass(frozen=True)
class RunPlan:
    """Everything a training run needs to know before it builds anything (see the module doc)."""

    mesh: Mesh
    layout: BatchLayout
    budget: Budget
    compute_dtype: str
    resume_from: str | None = None
    load_universal: bool = False


def takes_budget(factory: Callable[..., Any]) -> str | None:
    """The name under which `factory` wants the run's step budget (see BUDGET_PARAMETERS), or None."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in BUDGET_PARAMETERS if name in params), None)


def warmup_note(factory: Callable[..., Any], total_steps: int) -> str | None:
    """The line for a schedule whose warm-up (`warmup_steps`, as the factory was given it) lasts
    the whole run, so the learning rate never reaches its peak; None when it does."""
    given = getattr(factory, "keywords", {}).get("warmup_steps")
    if takes_budget(factory) is None or given is None or int(given) < total_steps:
        return None
    return (
        f"scheduler.warmup_steps={given} is not shorter than the run's {total_steps} optimizer steps: the "
        "learning rate never reaches its peak (lower scheduler.warmup_steps, or use scheduler.warmup_fraction)"
    )


def scheduler_for(factory: Callable[..., Any], total_steps: int) -> Callable[[Any], Any]:
    """`factory` as a one-argument `scheduler(optimizer)` that decays over `total_steps`."""
    name = takes_budget(factory)
    if name is None:
        return factory
    return lambda optimizer: factory(optimizer, **{name: max(1, total_steps)})
