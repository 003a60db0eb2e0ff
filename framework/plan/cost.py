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

The peak (`peak_bytes`) adds what exists only for a moment. At the optimizer step of stages 1-2,
DeepSpeed makes a flat fp32 copy of this rank's gradient partition (4 Ψ / N); at stage 3 it does
the same per sub-group (4 x min(sub group, Ψ / N)). While a ZeRO-3 layer computes, its
parameters are gathered whole and its gradient is whole until reduced (2 p L for the largest
parameter L). DeepSpeed's own estimators (`estimate_zero2/3_model_states_mem_needs`) count the
same parts (tested within 10 %); activations are not in either.

Under tensor parallelism of degree T, the parameters its plan splits count 1/T on a rank, and
N is the data-parallel degree that is left (processes / T); expert parallelism of degree E
divides the experts' parameters by E (`split_numel` counts what a plan splits). Sequence
parallelism splits activations, not model states.

The buffer sizes a strategy leaves as `auto` come from the model too (`auto_sizes`,
`chosen_sizes`); `framework.backend.estimate` applies all of this to a live module.
"""

from __future__ import annotations

import functools
import gc
import math
import re
from typing import Any

import torch
from torch import nn

from framework.plan.run_plan import mesh_of
from framework.plan.strategy import Strategy, parse_tp_style, plan_regex


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


def auto_sizes(num_params: int, largest_param: int, largest_block: int = 0) -> dict[str, int]:
    """Size-dependent ZeRO settings from the model, for settings left as "auto".

    With P parameters, L the largest one and B the largest block (a layer of the model's
    `nn.ModuleList`s, e.g. a transformer block; 0 when it has none), every size clamped to
    1e5 .. 5e8 elements and rounded up to a multiple of 64 (DeepSpeed asserts alignment):
      reduce / allgather bucket = min(L, P / 8)   small: a gradient bucket is a transient copy
      ZeRO-3 prefetch bucket    = max(L, B)       the next layer / block arrives while this one computes
      max live parameters       = 2 x prefetch    about two of the largest layers or blocks at once
      max reuse distance        = prefetch        a gathered layer is kept only if reused that soon
      persistence threshold     = 10 x sqrt(L)    biases / norms stay whole, like HF's 10 x hidden
      sub group                 = P / 4           optimizer step in ~4 chunks (matters under offload)
    DeepSpeed's own defaults (5e8-element buckets, 1e9 live parameters) are sized for large
    GPUs; the docs' Performance page (docs/performance.md) compares the two.
    """

    def clamp(n: int) -> int:
        return -(-int(min(max(n, 100_000), 500_000_000)) // 64) * 64

    largest = max(int(largest_param), 1)
    bucket = clamp(min(largest, num_params // 8))
    prefetch = clamp(max(largest, int(largest_block)))
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "prefetch_bucket_size": prefetch,
        "param_persistence_threshold": int(10 * math.isqrt(largest)),
        "max_live_parameters": 2 * prefetch,
        "max_reuse_distance": prefetch,
        "sub_group_size": -(-int(min(max(num_params // 4, 100_000), 1_000_000_000)) // 64) * 64,
    }


def chosen_sizes(
    strategy: Strategy, num_params: int, largest_param: int, largest_block: int = 0
) -> dict[str, int]:
    """The ZeRO size settings a run uses: the strategy's own values, "auto" ones from the model."""
    sizes = auto_sizes(num_params, largest_param, largest_block)
    s = strategy.sharding
    return {k: (v if getattr(s, k) in (None, "auto") else int(getattr(s, k))) for k, v in sizes.items()}


def _plan_regexes(plan: dict[str, str]) -> list[re.Pattern[str]]:
    """The module-name patterns of a plan's split layers (`*` = one name part)."""
    out = []
    for pattern, style in plan.items():
        if parse_tp_style(pattern, style)[0] == "replicate":
            continue
        out.append(re.compile(plan_regex(pattern, "weight|bias")))
    return out


def split_numel(module: nn.Module, strategy: Strategy) -> tuple[int, int]:
    """(parameters tensor parallelism splits, parameters expert parallelism splits) of `module`
    under `strategy`, for the memory estimate. Without a plan (a Hugging Face model's own
    `tp_plan`), the linear layers inside repeated blocks count as split, as they do under the
    usual column / row plans; experts are the parameters under an `experts` module."""
    tp, ep = strategy.tensor_parallel.degree, strategy.expert_parallel.degree
    named = [(name, p.numel()) for name, p in module.named_parameters()]
    tp_split = ep_split = 0
    if tp > 1:
        plan = strategy.tensor_parallel.plan or getattr(module, "tensor_parallel_plan", None)
        if plan:
            regexes = _plan_regexes(dict(plan))
            tp_split = sum(n for name, n in named if any(r.match(name) for r in regexes))
        else:
            linears = {
                f"{mod_name}.{p_name}"
                for mod_name, mod in module.named_modules()
                if isinstance(mod, nn.Linear) and re.search(r"\.\d+\.", f".{mod_name}.")
                for p_name, _ in mod.named_parameters(recurse=False)
            }
            tp_split = sum(n for name, n in named if name in linears)
    if ep > 1:
        ep_split = sum(n for name, n in named if ".experts." in f".{name}")
    return tp_split, ep_split


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
    transient = _step_and_working_bytes(strategy, num_params, largest_param, psi / n, p)
    device = params_device + grads + optim_device + buffers
    return {
        "parameters": int(num_params),
        "params_bytes": int(params),
        "grads_bytes": int(grads),
        "optimizer_bytes": int(optim),
        "buffer_bytes": int(buffers),
        "total_bytes": int(total),
        "device_bytes": int(device),
        "peak_bytes": int(device + transient),
        "cpu_bytes": int(cpu),
        "data_parallel_size": n,
        "parameters_per_rank": int(psi),
    }


def _step_and_working_bytes(
    strategy: Strategy, num_params: int, largest: int, partition: float, p: int
) -> float:
    """The device bytes that exist only at the optimizer step or while a ZeRO-3 layer computes
    (see the module doc); `partition`: this rank's parameters, Ψ / N."""
    stage = strategy.sharding.stage
    if stage in (1, 2):
        return 0.0 if strategy.sharding.offload_optimizer else 4 * partition
    if stage != 3:
        return 0.0
    sub_group = chosen_sizes(strategy, num_params, largest)["sub_group_size"]
    step = 0.0 if strategy.sharding.offload_optimizer else 4 * min(sub_group, partition)
    return step + 2 * p * largest


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
