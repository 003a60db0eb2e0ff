"""What preference tuning asks of other libraries' models: the reference model of a `peft`
model is the same model with its adapters disabled (`PeftModel.disable_adapter()`, as TRL's
`DPOTrainer` does), so no second copy of the weights is kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from framework.integrations import peft


def has_adapters(module: Any) -> bool:
    """True for a `peft` model (one whose adapters can be switched off)."""
    return peft.is_adapted(module)


@contextlib.contextmanager
def adapters_disabled(module: Any) -> Iterator[None]:
    """The block runs `module` (a `peft` model) as its base model: adapters off, back on after."""
    with module.disable_adapter():
        yield
