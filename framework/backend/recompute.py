"""Activation recomputation (`strategy.recompute.enable`) for models run outside the pipeline
engine (the pipeline engine recomputes its own layers: `activation_checkpoint_interval`).

Each recomputed unit keeps only its inputs during the forward pass and runs again in backward.
The unit's whole call is recomputed, module hooks included, the way Hugging Face checkpoints a
layer's `__call__`: under ZeRO-3, DeepSpeed's hooks gather the unit's parameters again for the
recomputation. Module names, parameters and `state_dict` keys do not change, so checkpoints
move freely between runs with and without recompute.

Units: what the model's `recompute_units()` returns, else every block of each `nn.ModuleList`
(transformer layers and the like).

A model that keeps a key/value cache while training (a Hugging Face model's `config.use_cache`)
gets it turned off, as transformers' Trainer does with gradient checkpointing: the recomputation
would append to the cache a second time and backward would see keys twice as long as the mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from framework.errors import ConfigError


def _recomputed_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if self.training and torch.is_grad_enabled():
        # early_stop=False: the recomputation runs to the end, so the module's post-forward hooks
        # (ZeRO-3 releases the gathered parameters there) run as in the first forward.
        runs = iter(range(2))  # the first call is the forward, the second the recomputation

        def call(*args: Any, **kwargs: Any) -> Any:
            if next(runs, 1) == 0:
                return nn.Module.__call__(self, *args, **kwargs)
            with _kept_for_backward(self):
                return nn.Module.__call__(self, *args, **kwargs)

        return checkpoint(call, *args, use_reentrant=False, early_stop=False, **kwargs)
    return nn.Module.__call__(self, *args, **kwargs)


_HELD = -1  # a sub-module id DeepSpeed never gives: marks weights held for the backward under way


@contextlib.contextmanager
def _kept_for_backward(unit: nn.Module) -> Iterator[None]:
    """ZeRO-3: weights that backward already gathered when it started the recomputation (a
    sub-module whose output feeds the block's output directly, e.g. Llama's `down_proj`) stay
    gathered through the recomputation's post-forward hooks, which would otherwise free them
    before their gradient is accumulated. Other weights are gathered and freed as in forward."""
    held: list[Any] = [p for p in unit.parameters() if getattr(p, "ds_active_sub_modules", None)]
    for p in held:
        p.ds_active_sub_modules.add(_HELD)
    try:
        yield
    finally:
        for p in held:
            p.ds_active_sub_modules.discard(_HELD)


_classes: dict[type, type] = {}


def _recomputed_class(cls: type) -> type:
    # `__call__` is looked up on the type: a subclass per model class carries the override, and
    # isinstance / the class name seen in reprs stay what the user wrote.
    if cls not in _classes:
        _classes[cls] = type(cls.__name__, (cls,), {"__call__": _recomputed_call, "_recomputed": True})
    return _classes[cls]


def recompute_units(model: nn.Module) -> list[nn.Module]:
    """The modules whose activations are recomputed (see the module doc)."""
    declared = getattr(model, "recompute_units", None)
    if callable(declared):
        return list(declared())
    return [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]


def enable(model: nn.Module, say: bool = True) -> list[nn.Module]:
    """Make every unit of `model` recompute its activations in backward; returns the units
    (`say`: print what changed in the model's config; rank 0 does)."""
    units = recompute_units(model)
    if not units:
        raise ConfigError(
            f"strategy.recompute.enable=true but {type(model).__name__} has no blocks to recompute: "
            "give it an nn.ModuleList of blocks or a recompute_units() method returning them"
        )
    for unit in units:
        if not getattr(unit, "_recomputed", False):
            unit.__class__ = _recomputed_class(type(unit))
    _cache_off(model, say)
    return units


def _cache_off(model: nn.Module, say: bool) -> None:
    """`use_cache=False` in the config of every sub-model that has one set (see the module doc)."""
    turned_off = []
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            turned_off.append(type(module).__name__)
    if turned_off and say:
        print(
            f"recompute: use_cache turned off for {turned_off[0]} (a key/value cache is not kept under "
            "activation recomputation, as in transformers' gradient checkpointing)",
            flush=True,
        )
