"""How many bytes of model state each rank holds, before anything runs (Paddle's cost model,
here an estimate of memory) — and a measurement of the same thing on a live process.

Per rank, with Ψ parameters, N data-parallel ranks, p bytes per parameter in the compute
dtype (4 fp32, 2 bf16/fp16) and K bytes of optimizer state per parameter (Adam 8, SGD with
momentum 4, plain SGD 0). DeepSpeed keeps a separate fp32 copy of the parameters (4 bytes) for
mixed precision at every stage and for ZeRO >= 1 in fp32 as well (measured)::

    stage   parameters   gradients   optimizer states (+ fp32 copy)
    0       p Ψ          p Ψ         (K + 4·amp) Ψ
    1       p Ψ          p Ψ         (K + 4) Ψ / N
    2       p Ψ          p Ψ / N     (K + 4) Ψ / N
    3       p Ψ / N      p Ψ / N     (K + 4) Ψ / N

plus, at stages 1 and 3, a reduce bucket of p x bucket elements that stays allocated. At
stage 1 with one micro-batch per optimizer step, DeepSpeed 0.19 reduces each gradient into its
partition during the (boundary) backward and frees the full one, as at stage 2, so gradients
take p Ψ / N there too (measured); with accumulation they stay whole until the step.

Offloaded parts live in CPU memory instead of the device's.

Under tensor parallelism of degree T, the parameters its plan splits count 1/T on a rank, and
N is the data-parallel degree that is left (processes / T); expert parallelism of degree E
divides the experts' parameters by E. Sequence parallelism splits activations, not model states.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch

from framework.backend.ds_config import chosen_sizes
from framework.backend.parallel import split_numel
from framework.plan.run_plan import mesh_of
from framework.plan.strategy import Strategy


def param_counts(module: torch.nn.Module) -> tuple[int, int]:
    """(total parameters, largest single parameter) — ZeRO-3-partitioned parameters counted whole."""
    sizes = [int(getattr(p, "ds_numel", p.numel())) for p in module.parameters()]
    return sum(sizes), max(sizes, default=0)


def largest_block(module: torch.nn.Module) -> int:
    """Parameters of the largest block of the model's `torch.nn.ModuleList`s (0 without any)."""
    blocks = [m for sub in module.modules() if isinstance(sub, torch.nn.ModuleList) for m in sub]
    return max((param_counts(b)[0] for b in blocks), default=0)


def optimizer_state_bytes_per_param(optimizer: Any) -> int:
    """K: fp32 bytes of optimizer state per parameter for a torch optimizer (class, factory or instance)."""
    target = optimizer.func if isinstance(optimizer, functools.partial) else optimizer
    cls = target if isinstance(target, type) else type(target)
    name = cls.__name__.lower()
    if "sgd" in name:
        momentum = 0.0
        if isinstance(optimizer, functools.partial):
            momentum = float(optimizer.keywords.get("momentum", 0.0))
        elif isinstance(optimizer, torch.optim.Optimizer):
            momentum = float(optimizer.defaults.get("momentum", 0.0))
        return 4 if momentum else 0
    if "adagrad" in name or "rmsprop" in name:
        return 4
    return 8  # Adam, AdamW, Lamb and most others keep two fp32 moments


def model_state_bytes(
    strategy: Strategy,
    num_params: int,
    largest_param: int,
    world_size: int,
    optimizer_bytes_per_param: int = 8,
    tp_split: int = 0,
    ep_split: int = 0,
) -> dict[str, int]:
    """Estimated bytes of parameters, gradients and optimizer states on each rank (see module
    doc). `tp_split` / `ep_split`: the parameters tensor / expert parallelism splits."""
    mesh = mesh_of(strategy, world_size)
    n = mesh.dp_size
    psi = num_params if not strategy.uses_pipeline else num_params // strategy.pipeline.stages
    psi -= tp_split - tp_split // mesh.tp_size + ep_split - ep_split // mesh.ep_size
    amp = strategy.amp.enable
    p = 2 if amp else 4
    stage = strategy.sharding.stage
    master = 4 if (amp or stage >= 1) else 0
    k = optimizer_bytes_per_param
    params = p * psi / (n if stage == 3 else 1)
    partitioned_grads = stage >= 2 or (stage == 1 and strategy.accumulation_steps == 1)
    grads = p * psi / (n if partitioned_grads else 1)
    optim = (k + master) * psi / (n if stage >= 1 else 1)
    buffers = 0.0
    if stage in (1, 3):  # a reduce bucket stays allocated (measured; ZeRO-2 frees its own)
        buffers = p * chosen_sizes(strategy, num_params, largest_param)["reduce_bucket_size"]
    cpu = 0.0
    if strategy.sharding.offload_optimizer:
        cpu += optim
        optim_device = 0.0
    else:
        optim_device = optim
    params_device = params
    if strategy.sharding.offload_params:
        cpu += params
        params_device = 0.0
    total = params + grads + optim + buffers
    return {
        "parameters": int(num_params),
        "params_bytes": int(params),
        "grads_bytes": int(grads),
        "optimizer_bytes": int(optim),
        "buffer_bytes": int(buffers),
        "total_bytes": int(total),
        "device_bytes": int(params_device + grads + optim_device + buffers),
        "cpu_bytes": int(cpu),
        "data_parallel_size": n,
        "parameters_per_rank": int(psi),
    }


def deepspeed_estimate(
    strategy: Strategy, num_params: int, largest_param: int, world_size: int
) -> dict[str, int] | None:
    """DeepSpeed's own estimator (it assumes fp16 mixed precision + Adam) for stages 2 and 3, else None."""
    stage = strategy.sharding.stage
    offload = strategy.sharding.offload_optimizer
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


def live_tensor_bytes(exclude: set[int] | None = None) -> tuple[int, set[int]]:
    """Bytes of all distinct tensor storages alive in this process (found through the garbage
    collector), and their ids; storages in `exclude` are not counted. Diagnostic, not fast."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            # A parameter's .grad has no Python object of its own until it is read: visit it here.
            for tensor in (obj, obj.grad) if obj.is_leaf and obj.requires_grad else (obj,):
                if tensor is None:
                    continue
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in (exclude or ()):
                    seen[ptr] = storage.nbytes()
        except Exception:
            continue
    return sum(seen.values()), set(seen)
