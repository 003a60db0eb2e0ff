"""The frozen reference policy of a method that pulls towards one (DPO; GRPO with a KL term).

Where its outputs come from, first match wins: the policy itself with its adapters switched off
(a `peft` model: `PeftModel.disable_adapter()`, as TRL does; no second copy of the weights), or a
frozen copy of the model made before DeepSpeed is built, handed at its first use to its own
DeepSpeed engine so that under ZeRO-3 it is partitioned like the policy (`Runtime.frozen`). A
model ZeRO-3 built partitioned (too large for one rank) cannot be copied: refused in one line,
naming what to do instead.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from framework.errors import ConfigError
from framework.integrations.peft import adapters_disabled
from framework.integrations.peft import is_adapted as has_adapters


class Reference:
    """The reference of one method (see the module doc). `module`: a frozen copy the user made
    (None: one is made when `attach` needs it)."""

    def __init__(self, module: torch.nn.Module | None = None):
        self.module = module
        self._placed = False
        if module is not None:
            module.eval().requires_grad_(False)

    def attach(self, model: torch.nn.Module, owner: str, instead: str) -> None:
        """Make the frozen copy of `model` (not yet given to DeepSpeed) when it is needed: not for
        a `peft` model, nor when the user gave one. `owner` and `instead` word the refusal of a
        model built partitioned ('DPO', 'set precompute_reference=True, ...')."""
        if self.module is not None or has_adapters(model):
            return
        if any(hasattr(p, "ds_id") for p in model.parameters()):  # built partitioned by zero.Init
            raise ConfigError(
                f"{owner} cannot copy a model built partitioned (too large for one rank) into a frozen "
                f"reference: {instead}"
            )
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

    @contextlib.contextmanager
    def model(self, engine: Any) -> Iterator[Any]:
        """The reference as a callable model for the block: the policy with adapters off, or the
        frozen copy (placed as the policy at its first use)."""
        if has_adapters(engine.module):
            with adapters_disabled(engine.module):
                yield engine.model
            return
        if self.module is None:
            raise ConfigError(
                "no reference model: give one (reference=copy.deepcopy(model)) or train adapters"
            )
        if not self._placed:  # partitioned like the policy under ZeRO-3
            self.module = engine.runtime.frozen(self.module)
            self._placed = True
        yield self.module

    def follow(self, runtime: Any) -> None:
        """Make the frozen copy the trained model as it is now (weights loaded after the copy was
        made: `Engine.load` of `trainer.init_from`), gathered whole from `runtime` (collective:
        every rank calls it). Nothing to do for adapters, or once the copy is placed."""
        if self.module is not None and not self._placed:
            self.module.load_state_dict(runtime.full_state_dict(on_every_rank=True))

    @property
    def is_copy(self) -> bool:
        """True when the reference is a frozen copy (not the policy with adapters off)."""
        return self.module is not None
