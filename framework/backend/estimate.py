"""Per-rank bytes of a model's states under a strategy and mesh (`framework.plan.cost`'s formulas
applied to a live module), with DeepSpeed's own estimators beside them."""

from __future__ import annotations

import dataclasses
from typing import Any

from framework.backend import deepspeed_globals, parallel, recompute
from framework.plan.cost import model_state_bytes, optimizer_state_bytes_per_param, param_counts, split_numel
from framework.plan.run_plan import mesh_of
from framework.plan.strategy import Strategy
from framework.plan.tune import ModelFacts


def deepspeed_estimate(
    strategy: Strategy, num_params: int, largest_param: int, world_size: int
) -> dict[str, int] | None:
    """DeepSpeed's own estimator (it assumes fp16 mixed precision + Adam) for stages 2 and 3, else None."""
    stage = strategy.sharding.stage
    offload = strategy.sharding.offload_optimizer
    if stage in (2, 3):
        deepspeed_globals.load()  # a cost asked before any run: DeepSpeed without mlflow
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(num_params, world_size, 1, offload, 1.0)
        return {"device_bytes": int(gpu), "cpu_bytes": int(cpu)}
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            num_params, largest_param, world_size, 1, offload, strategy.sharding.offload_params, True, 1.0
        )
        return {"device_bytes": int(gpu), "cpu_bytes": int(cpu)}
    return None


def estimate(
    module: Any, strategy: Strategy, optimizer: Any, world_size: int, mode: str = "train"
) -> dict[str, Any]:
    """Per-rank bytes of `module`'s model states under `strategy` (see the module doc) with
    `optimizer` (a torch optimizer, class or factory; None: no optimizer states), before anything
    runs; DeepSpeed's own estimate beside it. Eval / predict hold parameters only."""
    numel, largest = param_counts(module)
    k = optimizer_state_bytes_per_param(optimizer) if optimizer is not None else 8
    if mode != "train":
        k = 0
    tp_split, ep_split = split_numel(module, strategy)
    result: dict[str, Any] = model_state_bytes(strategy, numel, largest, world_size, k, tp_split, ep_split)
    if mode != "train":
        result["grads_bytes"] = 0
        result["total_bytes"] = result["params_bytes"] + result["optimizer_bytes"]
    result["largest_parameter"] = largest
    result["deepspeed_estimate"] = deepspeed_estimate(strategy, numel, largest, world_size)
    return result


def model_facts(module: Any, strategy: Strategy, optimizer: Any, world_size: int) -> ModelFacts:
    """What an autotune search needs of `module` (`framework.plan.tune.ModelFacts`): its sizes,
    what tensor parallelism would split, whether it has blocks to recompute, the degrees it takes.
    Works on a model built on the meta device (nothing is read but shapes). What training would
    refuse of `module` under `strategy` itself (`parallel.check_model`: a head count, the installed
    transformers for expert parallelism) is said first, in its own words."""
    parallel.check_model(strategy, mesh_of(strategy, world_size), module)
    numel, largest = param_counts(module)
    degrees = parallel.tp_degrees(module, world_size)
    split_strategy = strategy
    others = (
        strategy.uses_pipeline or strategy.sequence_parallel.degree > 1 or strategy.expert_parallel.degree > 1
    )
    if (
        max(degrees) > 1 and strategy.tensor_parallel.degree == 1 and not others
    ):  # what a degree > 1 would split
        split_strategy = dataclasses.replace(
            strategy, tensor_parallel=dataclasses.replace(strategy.tensor_parallel, degree=max(degrees))
        )
    tp_split, ep_split = split_numel(module, split_strategy)
    return ModelFacts(
        parameters=numel,
        largest_parameter=largest,
        optimizer_bytes_per_param=optimizer_state_bytes_per_param(optimizer) if optimizer is not None else 8,
        tp_split=tp_split,
        ep_split=ep_split,
        recomputable=bool(recompute.recompute_units(module)),
        tp_degrees=degrees,
    )
