"""Tensor, sequence and expert parallelism: what a model must satisfy, and its tensor-parallel plan.

The degrees live in the `Strategy`, the mesh of ranks in `framework.plan`; DeepSpeed's AutoTP,
Ulysses and AutoEP do the splitting (their JSON keys in `framework.backend.ds_config`). This module reads
the model: the head and expert counts a degree must divide (checked before DeepSpeed is built, a
one-line error instead of a shape error deep in a forward), and which plan splits its linears
(checked against the model's modules and shapes, the same way).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from framework.backend import expert_parallel, sequence_parallel
from framework.errors import ConfigError
from framework.integrations.hf import is_hf_model
from framework.plan.run_plan import Mesh
from framework.plan.strategy import Strategy, parse_tp_style, plan_regex

# Where a model states its head and expert counts: Hugging Face config names, then ours.
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads",)
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _config_value(module: nn.Module, names: tuple[str, ...]) -> int | None:
    config = getattr(module, "config", None)
    config = getattr(config, "text_config", None) or config
    for source in (config, module):
        for name in names:
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def tp_plan_of(strategy: Strategy, module: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan for `module`: the strategy's, else the model's own
    `tensor_parallel_plan`; None leaves the choice to DeepSpeed (a Hugging Face model's
    `tp_plan`, or the strategy's preset)."""
    tp = strategy.tensor_parallel
    if tp.degree <= 1:
        return None
    if tp.plan:
        return dict(tp.plan)
    own = getattr(module, "tensor_parallel_plan", None)
    if own:
        return dict(own)
    if tp.preset or is_hf_model(module):
        return None
    raise ConfigError(
        f"strategy.tensor_parallel.degree={tp.degree}: {type(module).__name__} says nothing of how its linears "
        "split; give strategy.tensor_parallel.plan (module name -> column / row / replicate), a "
        "`tensor_parallel_plan` attribute on the model, or strategy.tensor_parallel.preset"
    )


def tp_degrees(module: nn.Module, world_size: int) -> tuple[int, ...]:
    """The tensor-parallel degrees `module` can take on `world_size` processes (1 always): those
    that divide the processes and its heads, when it has a plan (its own `tensor_parallel_plan`,
    a Hugging Face model's `tp_plan`)."""
    config = getattr(module, "config", None)
    has_plan = bool(getattr(module, "tensor_parallel_plan", None) or getattr(module, "_tp_plan", None))
    has_plan = has_plan or bool(
        getattr(getattr(config, "text_config", None) or config, "base_model_tp_plan", None)
    )
    if not has_plan:
        return (1,)
    heads = _config_value(module, _HEADS)
    kv = _config_value(module, _KV_HEADS) or heads
    return tuple(
        d
        for d in range(1, world_size + 1)
        if world_size % d == 0 and (d == 1 or (heads is not None and heads % d == 0 and (kv or 0) % d == 0))
    )


def check_model(strategy: Strategy, mesh: Mesh, module: nn.Module) -> None:
    """One-line errors for degrees the model cannot take (heads, key-value heads, experts)."""
    heads = _config_value(module, _HEADS)
    kv = _config_value(module, _KV_HEADS) or heads
    for name, degree in (("tensor_parallel", mesh.tp_size), ("sequence_parallel", mesh.sp_size)):
        if degree <= 1:
            continue
        for what, count in (("attention heads", heads), ("key-value heads", kv)):
            if count is not None and count % degree:
                raise ConfigError(
                    f"strategy.{name}.degree={degree} does not divide the model's {count} {what}; "
                    f"use a degree that divides {count}"
                )
    plan = tp_plan_of(strategy, module) if mesh.tp_size > 1 else None
    if plan:
        check_plan(plan, module, mesh.tp_size)
    if mesh.sp_size > 1:
        sequence_parallel.check_model(module, mesh.sp_size)
    if mesh.ep_size > 1:
        experts = _config_value(module, _EXPERTS)
        if experts is None:
            raise ConfigError(
                f"strategy.expert_parallel.degree={mesh.ep_size}: {type(module).__name__} has no mixture-of-experts "
                "layers that DeepSpeed's AutoEP knows (a Hugging Face MoE model such as Mixtral or Qwen3-MoE)"
            )
        if experts % mesh.ep_size:
            raise ConfigError(
                f"strategy.expert_parallel.degree={mesh.ep_size} does not divide the model's {experts} experts; "
                f"use a degree that divides {experts}"
            )
        expert_parallel.check_transformers()


def check_plan(plan: dict[str, str], module: nn.Module, degree: int) -> None:
    """One line for a tensor-parallel plan entry that matches no module of `module` (a misspelt
    name would leave its partner split alone: a shape error in the forward) and for a split
    linear whose outputs (column) or inputs (row) the degree does not divide."""
    weights = {name: _shape(m) for name, m in module.named_modules() if len(_shape(m)) == 2}
    for pattern, style in plan.items():
        kind, parts = parse_tp_style(f"strategy.tensor_parallel.plan[{pattern!r}]", style)
        matched = [name for name in weights if re.match(plan_regex(pattern), f"{name}.weight")]
        if not matched:
            names = ", ".join(list(weights)[:8]) + (", ..." if len(weights) > 8 else "")
            raise ConfigError(
                f"strategy.tensor_parallel.plan[{pattern!r}] matches no module of {type(module).__name__} "
                f"(its layers with weights: {names}); name modules as model.named_modules() does, * for one part"
            )
        dim, what = (0, "outputs") if kind == "column" else (1, "inputs")
        for name in matched if kind != "replicate" else []:
            size = weights[name][dim]
            if size % (degree * parts):
                split = (
                    f"degree {degree} does not" if parts == 1 else f"{parts} parts x degree {degree} do not"
                )
                raise ConfigError(
                    f"strategy.tensor_parallel.plan[{pattern!r}]={style!r}: {name} has {size} {what}, which "
                    f"{split} divide; use a degree that divides {size // parts}, or replicate it"
                )


def _shape(module: nn.Module) -> tuple[int, ...]:
    """The whole shape of a module's own weight (not yet split; ZeRO-3 may have partitioned it), () without one."""
    weight = getattr(module, "weight", None)
    return tuple(getattr(weight, "ds_shape", weight.shape)) if isinstance(weight, torch.Tensor) else ()


def process_groups(mesh: Mesh, module: nn.Module | None = None) -> object | None:
    """What DeepSpeed's `initialize` takes as `mpu` for this mesh: DeepSpeed's own groups module,
    with its tensor-parallel mesh made first, so DeepSpeed's batch check counts data-parallel
    ranks, not processes (AutoTP would make the same mesh only later, inside the engine); under
    sequence parallelism its sequence-parallel groups, `module`'s attention switched to Ulysses
    (`framework.backend.sequence_parallel.prepare`)."""
    if mesh.sp_size > 1 and module is not None:
        return sequence_parallel.prepare(module, mesh)
    if mesh.tp_size <= 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=mesh.tp_size)
    return groups


def grad_norm(params: list[nn.Parameter], mesh: Mesh, device: torch.device) -> torch.Tensor | None:
    """The global L2 norm of `params`' gradients on a rank whose data-parallel gradients are
    already reduced (ZeRO-0): a tensor-parallel layer's shards are summed over its ranks, a
    weight every such rank holds whole counts once (DeepSpeed's rule for model-parallel norms);
    experts split over ranks count on each. Collective over the tensor- and expert-parallel ranks
    (their tensors on `device`, this rank's). Stays a tensor: no device sync."""
    split, experts = mesh.tp_size > 1, mesh.ep_size > 1
    grads = [
        p.grad.detach().float()
        for p in params
        if p.grad is not None
        and (not split or mesh.mp_rank == 0 or getattr(p, "tensor_model_parallel", False))
        and not (experts and expert_parallel.is_expert_param(p))
    ]
    if not grads and not split and not experts:
        return None
    squares = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros(())
    if split:
        from deepspeed.utils import groups

        squares = squares.to(device)
        torch.distributed.all_reduce(squares, group=groups.get_tensor_model_parallel_group())
    if experts:  # each rank's experts are others: their squares are summed over the expert ranks
        squares = squares + expert_parallel.expert_grad_squares(params, device).to(squares.device)
    return squares.sqrt()
