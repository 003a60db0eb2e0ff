"""Turning a model into DeepSpeed pipeline stages, and driving the PipelineEngine.

A model is split from its own `pipeline_layers()` (a list of modules / `LayerSpec`s, tied
layers allowed) or, for an `nn.Sequential`, from its children. Training is the iterator
flavour driven by the framework: each `train_batch(data_iter)` pulls `accumulate_steps`
micro-batches from the counted, prefetched iterator and makes one optimizer step.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError
from framework.plan.strategy import Strategy

SCHEDULES = ("1F1B",)


def tied_layer(
    key: str, layer: type[nn.Module], *args: Any, forward_fn: Callable[..., Any] | None = None
) -> Any:
    """A layer of `pipeline_layers()` that shares its weights with every other layer of the same
    `key` (an input embedding and the output head), built on whichever stages hold it as
    `layer(*args)`; `forward_fn(module, x)` replaces its forward where given (DeepSpeed's
    `TiedLayerSpec`: a model declares ties without importing DeepSpeed)."""
    from deepspeed.pipe import TiedLayerSpec

    return TiedLayerSpec(key, layer, *args, forward_fn=forward_fn)


def pipeline_layers(model: nn.Module) -> list[Any]:
    """The model's layers in order, or a clear error if it cannot be split."""
    split = getattr(model, "pipeline_layers", None)
    if callable(split):
        layers = list(split())
    elif isinstance(model, nn.Sequential):
        layers = list(model.children())
    else:
        raise ConfigError(
            f"{type(model).__name__} cannot be split into pipeline stages: give it a pipeline_layers() "
            "method returning its layers in order, or build it as an nn.Sequential"
        )
    return layers


def build_pipeline_module(
    model: nn.Module, strategy: Strategy, loss_fn: Callable[..., torch.Tensor]
) -> nn.Module:
    """A DeepSpeed `PipelineModule` over the model's layers, starting from the model's weights
    (tied layers included), partitioned as `strategy.pipeline` says."""
    from deepspeed.pipe import PipelineModule

    p = strategy.pipeline
    if p.schedule not in SCHEDULES:
        raise ConfigError(
            f"strategy.pipeline.schedule={p.schedule!r} is not supported; use one of {list(SCHEDULES)}"
        )
    layers = pipeline_layers(model)
    if len(layers) < p.stages:
        raise ConfigError(
            f"{type(model).__name__} has {len(layers)} pipeline layer(s): too few for strategy.pipeline.stages={p.stages}"
        )
    with contextlib.redirect_stdout(io.StringIO()):  # PipelineModule prints its partitioning
        pipe = PipelineModule(
            layers=layers,
            num_stages=p.stages,
            loss_fn=loss_fn,
            partition_method=p.partition_method,
            # recompute.enable alone recomputes every layer; an explicit interval wins
            activation_checkpoint_interval=p.activation_checkpoint_interval or int(strategy.recompute.enable),
        )
    for key, tied in getattr(pipe, "tied_modules", {}).items():
        source = getattr(model, key, None)
        if isinstance(source, nn.Module):
            tied.load_state_dict(source.state_dict())
    return pipe


def train_batch(pipe_engine: Any, batches: Iterator[Any]) -> torch.Tensor:
    """One pipeline optimizer step over `accumulate_steps` micro-batches pulled from `batches`."""
    return pipe_engine.train_batch(data_iter=batches)


def eval_batch(pipe_engine: Any, batches: Iterator[Any]) -> torch.Tensor:
    """Mean loss over `accumulate_steps` micro-batches, without gradients (on every stage)."""
    pipe_engine.total_loss = None  # a previous train_batch leaves it set; eval_batch would reuse its shape
    return pipe_engine.eval_batch(
        data_iter=batches, return_logits=False, compute_loss=True, reduce_output="avg"
    )


def local_state_dict(pipe: nn.Module, model: nn.Module, master: bool = False) -> dict[str, torch.Tensor]:
    """The weights this stage holds, as CPU tensors under the model's own parameter names (tied
    layers map onto the model attribute of their key). `master`: each parameter from the
    optimizer's fp32 master copy where DeepSpeed keeps one (bf16), so it is not rounded.
    Collective over this stage's data-parallel group when `master`."""
    names = {id(m): n for n, m in model.named_modules()}
    mine: dict[str, torch.Tensor] = {}
    for child_name, child in pipe.named_children():
        if child_name == "tied_modules":
            for key, tied in child.named_children():
                mine.update({f"{key}.{k}": v for k, v in _weights(tied, master).items()})
        elif id(child) in names:
            mine.update({f"{names[id(child)]}.{k}": v for k, v in _weights(child, master).items()})
    return mine


def _weights(module: nn.Module, master: bool) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {}
    if master:
        masters = {id(p): safe_get_full_fp32_param(p) for p in module.parameters()}
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        high = masters.get(id(value))
        out[key] = (high if high is not None else value).detach().cpu().clone()
    return out
