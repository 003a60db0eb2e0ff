"""What a loss that applies a model's output head itself needs of DeepSpeed: each pass entered as
a module call, so that ZeRO-3 gathers the weights it reads, once per pass.

A chunked loss (`framework.methods.chunked`) runs the model's backbone, then multiplies the
hidden states by the head's weight in chunks of positions, never computing the logits. Under
ZeRO-3 every weight is partitioned (empty on each rank) outside the module call that gathers it:
DeepSpeed's hooks fetch a module's weights before its forward pass and release them after, fetch
them again when the gradient reaches the module's outputs and release them when it has passed its
inputs, with the weights' gradients accumulated (and reduced) in between. A loss that read the
head's weight outside such a call would see an empty tensor, and a gradient accumulated into a
released weight fails. So:

* `call_as_forward(model, fn, ...)` runs `fn` as the forward pass of `model`: a DeepSpeed engine
  (its forward arms ZeRO-3's hooks) or a module, whose own call and hooks run as for a plain
  forward, `fn` standing in for its `forward` for that one call. The loss runs the model this way,
  and inside it the head module, whose hooks then gather the head's weights once around all the
  chunks of the forward pass and once around their recomputation in the backward pass, never per
  chunk;
* `hold_with(head, params)` makes weights the head's call reads but other modules hold (a LoRA
  adapter's matrices, a `modules_to_save` copy) part of what its hooks gather (DeepSpeed's
  external parameters).

Below ZeRO-3 the calls are plain calls and nothing is gathered.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def inner_module(model: Any) -> nn.Module:
    """The module a forward pass runs: the one DeepSpeed's engine wraps, or `model` itself."""
    if "deepspeed" in sys.modules:
        from deepspeed import DeepSpeedEngine

        if isinstance(model, DeepSpeedEngine):
            return model.module
    return model


def call_as_forward(model: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` run as the forward pass of `model` (a DeepSpeed engine or a module):
    through the engine's forward and the module's own call with its hooks, `fn` standing in for
    the module's `forward` for this call only."""
    module = inner_module(model)
    own = module.__dict__.get("forward")  # a forward set on the instance, kept as it is

    def restore() -> None:
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = own

    def forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()  # a nested call of the module runs its own forward
        return fn(*inner_args, **inner_kwargs)

    module.__dict__["forward"] = forward
    try:
        return model(*args, **kwargs)
    finally:
        restore()


def hold_with(module: nn.Module, params: Iterable[torch.Tensor | None]) -> None:
    """Under ZeRO-3, `params` (weights of other modules that a call of `module` reads) gathered and
    released with `module`'s own in its forward and backward passes; nothing otherwise."""
    own = {id(p) for p in module.parameters(recurse=False)}
    foreign = [p for p in params if p is not None and hasattr(p, "ds_id") and id(p) not in own]
    if foreign:
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        for param in foreign:
            register_external_parameter(module, param)
