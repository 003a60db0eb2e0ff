"""Strategy + batch layout + model sizes -> the DeepSpeed config dict.

The only module that knows DeepSpeed's JSON keys. Pure: the same inputs give the same dict.
"""

from __future__ import annotations

import copy
from typing import Any

from framework.plan.cost import chosen_sizes
from framework.plan.run_plan import BatchLayout
from framework.plan.strategy import Strategy, parse_tp_style, plan_regex


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _batch_keys(layout: BatchLayout) -> dict[str, Any]:
    return {
        "train_batch_size": layout.global_batch_size,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.accumulation_steps,
    }


def _precision(strategy: Strategy) -> dict[str, Any]:
    if not strategy.amp.enable:
        return {}
    if strategy.amp.dtype == "bf16":
        return {"bf16": {"enabled": True}}
    return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}


def _zero_section(
    strategy: Strategy, num_params: int, largest_param: int, pin_memory: bool, largest_block: int = 0
) -> dict[str, Any]:
    s = strategy.sharding
    zero: dict[str, Any] = {"stage": s.stage}
    if s.stage == 0:
        return zero
    chosen = chosen_sizes(strategy, num_params, largest_param, largest_block)
    zero["reduce_bucket_size"] = chosen["reduce_bucket_size"]
    zero["allgather_bucket_size"] = chosen["allgather_bucket_size"]
    if s.stage == 3:
        zero["stage3_prefetch_bucket_size"] = chosen["prefetch_bucket_size"]
        zero["stage3_param_persistence_threshold"] = chosen["param_persistence_threshold"]
        zero["stage3_max_live_parameters"] = chosen["max_live_parameters"]
        zero["stage3_max_reuse_distance"] = chosen["max_reuse_distance"]
        zero["sub_group_size"] = chosen["sub_group_size"]
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if s.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return zero


def _layer_specs(plan: dict[str, str]) -> list[dict[str, Any]]:
    specs = []
    for module_pattern, style in plan.items():
        kind, fused = parse_tp_style(f"tensor-parallel plan[{module_pattern!r}]", style)
        spec: dict[str, Any] = {
            "patterns": [plan_regex(module_pattern)],
            "partition_type": "skip" if kind == "replicate" else kind,
        }
        if fused > 1:
            spec["shape"] = [fused, -1]
            spec["partition_dim"] = 0
        specs.append(spec)
    return specs


def _model_parallel(strategy: Strategy, tp_plan: dict[str, str] | None) -> dict[str, Any]:
    """DeepSpeed's AutoTP / Ulysses / AutoEP sections for the strategy's degrees."""
    out: dict[str, Any] = {}
    tp = strategy.tensor_parallel
    if tp.degree > 1:
        section: dict[str, Any] = {"autotp_size": tp.degree}
        if tp_plan:
            section["partition_config"] = {"use_default_specs": False, "layer_specs": _layer_specs(tp_plan)}
        elif tp.preset:
            section["preset_model"] = tp.preset
        out["tensor_parallel"] = section
    if strategy.sequence_parallel.degree > 1:
        out["sequence_parallel_size"] = strategy.sequence_parallel.degree
    ep = strategy.expert_parallel
    if ep.degree > 1:
        expert: dict[str, Any] = {"enabled": True, "autoep_size": ep.degree}
        if ep.preset:
            expert["preset_model"] = ep.preset
        out["expert_parallel"] = expert
    return out


def deepspeed_config(
    strategy: Strategy,
    layout: BatchLayout,
    num_params: int = 0,
    largest_param: int = 0,
    load_universal: bool = False,
    pin_memory: bool = False,
    largest_block: int = 0,
    tp_plan: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict for `strategy` with this batch layout.

    `num_params`/`largest_param` size the "auto" ZeRO settings; `load_universal` reads a
    checkpoint converted for another world size; `pin_memory` page-locks offloaded states (on a
    GPU machine: faster copies to and from the device); `largest_block` sizes ZeRO-3's prefetch;
    `tp_plan` is the tensor-parallel plan of the model (`framework.plan.strategy.TensorParallel`).
    """
    config: dict[str, Any] = {
        **_batch_keys(layout),
        "steps_per_print": None,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(strategy, num_params, largest_param, pin_memory, largest_block),
        # We hand DeepSpeed torch optimizers (SGD, AdamW, ...) and keep them under offload too,
        # which avoids the JIT build of DeepSpeedCPUAdam on a first run.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        **_precision(strategy),
        **_model_parallel(strategy, tp_plan),
        # Always explicit: DeepSpeed 0.19 defaults to clipping at 1.0, which would silently change
        # every update whose gradient norm exceeds 1.
        "gradient_clipping": float(max(strategy.gradient_clip.max_norm, 0.0)),
    }
    if strategy.recompute.enable:
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,  # crashes on CPU
            "contiguous_memory_optimization": False,
        }
    if "timers" not in strategy.deepspeed:
        # DeepSpeed's throughput timer is on by default and synchronizes the device twice per
        # micro-batch (the host stalls on CUDA); the framework measures speed itself. A raw
        # `timers` section is DeepSpeed's as written, with DeepSpeed's defaults.
        config["timers"] = {"throughput": {"enabled": False, "synchronized": False}}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    optimizer = strategy.deepspeed.get("optimizer")
    extra = strategy.deepspeed
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        # Without torch_adam DeepSpeed builds FusedAdam, a JIT build of about a minute.
        params = dict(optimizer.get("params", {}))
        params.setdefault("torch_adam", not strategy.sharding.offload_optimizer)
        extra = _deep_merge(extra, {"optimizer": {"params": params}})
    return _deep_merge(config, extra)


def zero_init_config(strategy: Strategy, layout: BatchLayout, pin_memory: bool = False) -> dict[str, Any]:
    """What `deepspeed.zero.Init` reads: the batch triple (it validates one), the ZeRO stage and
    parameter offload, and the dtype (passing a dtype as well makes DeepSpeed 0.19 pick bf16 on
    any accelerator without fp16)."""
    zero: dict[str, Any] = {"stage": strategy.sharding.stage}
    if strategy.sharding.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return {**_batch_keys(layout), "zero_optimization": zero, **_precision(strategy)}


def configures_optimizer(strategy: Strategy) -> bool:
    """True when the strategy's raw DeepSpeed section names an optimizer for DeepSpeed to build."""
    return "optimizer" in strategy.deepspeed
