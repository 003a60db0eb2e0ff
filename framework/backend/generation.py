"""The trained model whole for generation: under ZeRO-3 every parameter gathered once for the
whole rollout, not layer by layer for every new token.

Through DeepSpeed's engine a ZeRO-3 model gathers each layer's weights before the layer runs and
frees them after: fine for a training step (one forward, one backward), ruinous for generation,
where every new token is a forward pass (TRL issue 3858; measured here, a 4-layer model on 2 ranks
took 6.8 s to generate 32 tokens that way and 0.4 s with its weights gathered once). So for the
block the weights are gathered whole (`deepspeed.zero.GatheredParameters`) and ZeRO-3's forward
and backward hooks are taken off the module, then put back (and the coordinator's recorded trace
dropped, since generation ran outside it) when the block ends, which frees the gathered weights.
Where this DeepSpeed keeps the hooks elsewhere, the weights are still gathered once and the hooks
stay (slower, as correct); below ZeRO-3 the module runs as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from framework.backend import deepspeed_globals


def _parameter_offload(ds_engine: Any) -> Any:
    """ZeRO-3's parameter-offload object of a DeepSpeed engine (its hooks), or None."""
    optimizer = getattr(ds_engine, "optimizer", None)
    found = getattr(optimizer, "parameter_offload", optimizer)
    return found if hasattr(found, "forward_hooks") and hasattr(found, "_register_deepspeed_module") else None


@contextlib.contextmanager
def _hooks_off(offload: Any) -> Iterator[None]:
    for param in offload.module.parameters(recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        coordinator = getattr(offload, "param_coordinator", None)
        if coordinator is not None and not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def whole(module: nn.Module, ds_engine: Any, zero3: bool) -> Iterator[nn.Module]:
    """`module` with all its weights on this rank for the block (see the module doc)."""
    if not zero3:
        yield module
        return
    deepspeed = deepspeed_globals.load()

    offload = _parameter_offload(ds_engine)
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        with _hooks_off(offload) if offload is not None else contextlib.nullcontext():
            yield module
