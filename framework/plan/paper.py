"""Autotune on paper, for a cluster that is not here: the layouts of a search for a device count
and a memory per device, ranked by the cost model alone (nothing runs). Those that fit come first,
then the ones expected faster (`paper_cost`), then the simpler (`Layout.simplicity`).

The cost model holds model states (`framework.plan.cost`: parameters, gradients, optimizer states,
DeepSpeed's buffers and step-time copies), not activations: micro-batch and recompute, which move
activations only, are not ranked here; tune them by measuring on one node of the cluster.
"""

from __future__ import annotations

from collections.abc import Iterable

from framework.plan.strategy import Strategy
from framework.plan.tune import Layout, ModelFacts, Trial, candidates, trials_for

# How much longer a step takes, on paper, per knob: recompute runs each block's forward twice
# (about 4/3 of the compute); ZeRO-3 gathers parameters in forward and backward (about 1.5x the
# communication of ZeRO 0-2); offload moves the optimizer step to the host.
PAPER_COST = {"recompute": 4 / 3, "stage3": 1.5, "offload": 2.0}


def paper_cost(layout: Layout) -> float:
    """A relative step cost for ranking layouts on paper (1 = ZeRO 0-2, no recompute, no offload)."""
    cost = PAPER_COST["recompute"] if layout.recompute else 1.0
    cost *= PAPER_COST["stage3"] if layout.stage == 3 else 1.0
    return cost * (PAPER_COST["offload"] if layout.offload else 1.0)


def on_paper(
    base: Strategy,
    facts: ModelFacts,
    devices: int,
    memory_gb: float,
    margin: float,
    global_batch: int,
    space: Iterable[str] = ("stage", "offload", "tensor_parallel"),
) -> list[Trial]:
    """The layouts of `space` for `devices` ranks of `memory_gb` each, ranked by the cost model
    alone: those that fit first, then by `paper_cost`, then the simpler. Micro-batch and recompute
    change activations, which the cost model leaves out: they are tuned by measuring."""
    chosen = set(space) - {"micro_batch", "recompute"}
    layouts = candidates(base, facts, devices, global_batch, chosen, offload_possible=True)
    trials = trials_for(layouts, base, facts, devices, global_batch)
    limit = memory_gb * margin
    for trial in trials:
        trial.fits = trial.estimated_gb <= limit
        trial.status = (
            "fits on paper" if trial.fits else f"over: {trial.estimated_gb:.3g} GB > {limit:.3g} GB"
        )
        trial.extra = {"paper_cost": round(paper_cost(trial.layout), 3)}
    return sorted(trials, key=lambda t: (not t.fits, paper_cost(t.layout), t.layout.simplicity))


def table(trials: list[Trial]) -> list[str]:
    """The console table of a paper plan: layout, estimated GB per rank, relative step cost, status."""
    rows = [f"{'layout':<38} {'est GB':>8} {'cost':>6}  status"]
    rows += [f"{t.name:<38} {t.estimated_gb:8.3f} {paper_cost(t.layout):6.2f}  {t.status}" for t in trials]
    return rows
