"""Pure numbers, decided before anything is built: the `Strategy`, the run plan (mesh, batch
layout, step budget) and the cost model's formulas.

Rule: imports only `framework.errors`; no process group, no DeepSpeed, no Hydra, no model is
built here. What a run is and how it splits is computed once, here, and handed down.

* `strategy`   `Strategy` and its sections (Paddle's auto-parallel Strategy), validated;
* `run_plan`   `Mesh` (the one place the data-parallel degree is derived), `batch_layout` (the one
               place a global batch is split), `step_budget`, `RunPlan`;
* `cost`       bytes of model states per rank under a strategy, the buffer sizes `auto` picks;
* `layouts`    what a search is made of: `Layout`, `Trial`, `ModelFacts`;
* `tune`       autotune's search: the candidate layouts, what the cost model rules out, which
               measured one wins;
* `paper`      autotune on paper: layouts for a cluster that is not here, by the cost model alone.
"""

from framework.plan.run_plan import BatchLayout, Budget, Mesh, RunPlan, batch_layout, mesh_of, step_budget
from framework.plan.strategy import Strategy

__all__ = ["BatchLayout", "Budget", "Mesh", "RunPlan", "Strategy", "batch_layout", "mesh_of", "step_budget"]
