"""Expert parallelism on DeepSpeed's AutoEP: what it needs, and what the rest of the framework must
know of a model whose experts are split.

AutoEP (`framework.backend.ds_config` writes its `expert_parallel` section) replaces each mixture-of-experts
block of a Hugging Face model by an `AutoEPMoELayer`: the router as `router.gate`, and this rank's
share of the experts as grouped tensors `experts.w1` (gate), `experts.w3` (up) and `experts.w2`
(down), `[local experts, out, in]`. Here:

- `check_transformers`: AutoEP hooks into transformers' output recorders, which changed shape in
  5.23 (a registry became a dict subclass: `TypeError: _CanRecordRegistry.get()` deep inside
  DeepSpeed's engine); said in one line before DeepSpeed is built.
- `optimizer_with_expert_groups`: the optimizer gets DeepSpeed's MoE param groups.
- `whole_experts` + `source_layout`: consolidated weights (`framework.backend.weights.consolidate`: export,
  `full_state_dict`) are the model's own, every expert gathered, under its Hugging Face names.
- `expert_grad_squares`: the experts' share of the global gradient norm (ZeRO-0).
- `unshare_optimizer_steps`: a ZeRO-3 universal load's shared `step` tensor, made one per state.
- `refuse_whole_weights`, `has_split_experts`: one-line errors where whole weights meet split
  experts (a weights file loaded, a checkpoint exported).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError
from framework.integrations import hf
from framework.plan.strategy import Strategy

# The transformers releases AutoEP (DeepSpeed 0.19) runs with, found by running it: 5.0 brought
# the fused expert tensors its presets read (Mixtral, Qwen3-MoE, DeepSeek; a few presets need
# later ones and say so themselves), 5.23 the registry it cannot handle.
TRANSFORMERS_MIN, TRANSFORMERS_MAX = "5.0.0", "5.22.2"
INSTALL = f'pip install "transformers>={TRANSFORMERS_MIN},<={TRANSFORMERS_MAX}"'


def check_transformers(version: str | None = None) -> None:
    """A one-line ConfigError unless the installed transformers (or `version`) is one AutoEP
    runs with."""
    from packaging.version import Version

    if version is None:
        version = hf.transformers_version()
        if version is None:
            raise ConfigError(
                "strategy.expert_parallel needs transformers (DeepSpeed's AutoEP splits Hugging Face MoE "
                f"models); install it: {INSTALL}"
            )
    if not Version(TRANSFORMERS_MIN) <= Version(version) <= Version(TRANSFORMERS_MAX):
        raise ConfigError(
            f"strategy.expert_parallel: DeepSpeed's AutoEP runs with transformers {TRANSFORMERS_MIN} to "
            f"{TRANSFORMERS_MAX}, and {version} is installed; install a working one: {INSTALL}"
        )


def optimizer_with_expert_groups(strategy: Strategy, optimizer: Any) -> Any:
    """The optimizer factory DeepSpeed calls, given its parameters in DeepSpeed's MoE groups
    (ZeRO 1/2 reduce and partition the experts over their own data-parallel group, and refuse a
    param group that does not say which one). An optimizer already built has its groups from
    before AutoEP replaced the experts: DeepSpeed moves the new experts into them, which ZeRO 0
    and 3 train exactly, and ZeRO 1/2 refuse (said here in one line)."""
    if strategy.expert_parallel.degree <= 1 or optimizer is None:
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        if strategy.sharding.stage in (1, 2):
            raise ConfigError(
                f"strategy.expert_parallel with sharding.stage={strategy.sharding.stage} needs the optimizer as a "
                "factory of parameters, built after DeepSpeed splits the experts: "
                "functools.partial(torch.optim.AdamW, lr=...), or the optimizer config group"
            )
        return optimizer
    from deepspeed.moe.utils import configure_moe_param_groups

    return lambda params: optimizer(configure_moe_param_groups(list(params)))


def is_expert_param(param: torch.Tensor) -> bool:
    """True for a parameter that holds some of the experts (each expert-parallel rank others)."""
    return getattr(param, "allreduce", True) is False and hasattr(param, "group_name")


def expert_grad_squares(params: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The squared L2 norm of the gradients of the experts among `params`, summed over the ranks
    that hold the other experts. Collective over each expert-parallel group (on `device`)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    total = torch.zeros((), device=device)
    by_group: dict[str, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and is_expert_param(p):
            by_group.setdefault(p.group_name, []).append(p.grad.detach().float())  # type: ignore[attr-defined]
    for name in sorted(by_group):  # the same order on every rank
        squares = torch.stack(torch._foreach_norm(by_group[name])).square().sum().to(total.device)
        dist.all_reduce(squares, group=groups._get_expert_parallel_group(name))
        total = total + squares
    return total


def unshare_optimizer_steps(optimizer: Any) -> None:
    """Give every optimizer state its own `step` tensor. DeepSpeed's ZeRO-3 universal load hands
    one tensor to all its sub-groups (one per MoE group under expert parallelism): torch's Adam
    adds 1 to it in place for each, so the bias correction runs ahead and the resumed run drifts."""
    seen: set[int] = set()
    for state in getattr(optimizer, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def refuse_whole_weights(module: nn.Module) -> None:
    """A one-line error for loading whole weights into a model whose experts AutoEP split (each
    rank holds other experts): the model is built from them instead."""
    if any(is_expert_layer(m) for m in module.modules()):
        raise ConfigError(
            "strategy.expert_parallel: whole weights cannot be loaded into a model whose experts are split "
            "over ranks (trainer.init_from, Engine.load of a weights file); build the model from them "
            "instead (from_pretrained, model.path) or resume a checkpoint"
        )


def has_split_experts(parameter_names: Iterable[str]) -> bool:
    """True for the parameter names of a model whose experts AutoEP split (its grouped
    `experts.w1`): a checkpoint of it holds each rank's experts apart."""
    return any(name.split(".")[-2:] == ["experts", "w1"] for name in parameter_names)


def is_expert_layer(module: nn.Module) -> bool:
    """True for the MoE layer AutoEP puts in place of a model's own."""
    return bool(getattr(module, "_is_autoep_layer", False))


def expert_layers(module: nn.Module) -> dict[int, nn.Module]:
    """{id(grouped experts module): its AutoEP layer} for every AutoEP layer in `module`."""
    return {id(layer.experts): layer for layer in module.modules() if is_expert_layer(layer)}


def whole_experts(layer: nn.Module | None, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The grouped expert tensors `values` (this rank's experts of AutoEP `layer`) with every
    expert, gathered over the layer's expert-parallel ranks in expert order. Collective over
    that group; `values` unchanged when `layer` is None."""
    if layer is None:
        return list(values)
    import torch.distributed as dist

    group, size = layer.ep_group, int(layer.ep_size)  # type: ignore[arg-type]
    ranks = torch.tensor([int(layer.ep_rank)], dtype=torch.long)  # type: ignore[arg-type]
    order = [torch.zeros_like(ranks) for _ in range(size)]
    dist.all_gather(order, ranks, group=group)  # which expert slice each member holds
    out = []
    for value in values:
        parts = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(parts, value.detach().contiguous(), group=group)
        by_slice = sorted(zip((int(r) for r in order), parts), key=lambda pair: pair[0])
        out.append(torch.cat([part for _, part in by_slice]))
    return out


def source_layout(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (consolidated, every expert whole) with each AutoEP layer's entries under the
    model's own names: the router as `<router>.weight`, the experts as the preset's tensors
    (Mixtral / Qwen3-MoE: `experts.gate_up_proj` [E, 2 x ffn, hidden], `experts.down_proj`)."""
    layers = [(name, layer) for name, layer in module.named_modules() if is_expert_layer(layer)]
    if not layers:
        return state
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    renamed: dict[str, torch.Tensor] = {}
    for name, layer in layers:
        preset = PRESET_MODELS.get(layer.model_family)
        if preset is None or preset.expert_storage != "fused_3d":
            raise ConfigError(
                f"strategy.expert_parallel: whole weights of AutoEP's {layer.model_family!r} layers are not "
                "supported (only presets with fused expert tensors, such as Mixtral and Qwen3-MoE)"
            )
        prefix = f"{name}." if name else ""
        router = {f"{prefix}{child}." for child, sub in layer.named_children() if sub is layer.router}
        experts = {w: state.pop(f"{prefix}experts.{w}") for w in ("w1", "w2", "w3")}
        for key in [k for k in state if any(k.startswith(r) for r in router)]:
            value = state.pop(key)  # the router's aliases are dropped, its own entries renamed
            if key.startswith(f"{prefix}router."):  # gate.weight, e_score_correction_bias (DeepSeek-V3)
                own = key[len(f"{prefix}router.") :].removeprefix("gate.")
                renamed[f"{prefix}{preset.router_pattern}.{own}"] = value
        experts_at = f"{prefix}{preset.experts_pattern}."
        if preset.expert_w3 is None:  # gate and up fused, gate first (Transformers' layout)
            renamed[experts_at + preset.expert_w1] = torch.cat([experts["w1"], experts["w3"]], dim=1)
        else:
            renamed[experts_at + preset.expert_w1] = experts["w1"]
            renamed[experts_at + preset.expert_w3] = experts["w3"]
        renamed[experts_at + preset.expert_w2] = experts["w2"]
    return {**state, **renamed}
