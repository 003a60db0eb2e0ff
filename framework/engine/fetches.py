"""`Engine.run(fetch_list=[...])`: outputs of named sub-modules, and the run's own quantities."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# Names that are not sub-modules: read from the runtime after the step.
SPECIAL = ("lr", "grad_norm", "loss_scale")


@contextlib.contextmanager
def capture(module: nn.Module, names: list[str] | None) -> Iterator[dict[str, list[Any]]]:
    """Record the outputs of the sub-modules `names` while the block runs."""
    captured: dict[str, list[Any]] = {}
    modules = dict(module.named_modules())
    handles = []
    for name in names or []:
        if name in SPECIAL:
            continue
        if name not in modules:
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise ValueError(f"fetch_list name {name!r} is not a sub-module of {type(module).__name__}{hint}")

        def hook(_module: nn.Module, _inputs: Any, output: Any, _name: str = name) -> None:
            captured.setdefault(_name, []).append(
                output.detach() if isinstance(output, torch.Tensor) else output
            )

        handles.append(modules[name].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def collect(names: list[str] | None, captured: dict[str, list[Any]], runtime: Any) -> dict[str, Any]:
    """The fetched values: captured outputs (concatenated over micro-batches) and lr / grad_norm /
    loss_scale from the runtime."""
    out: dict[str, Any] = {}
    for name in names or []:
        if name in SPECIAL:
            out[name] = getattr(runtime, name)
            continue
        values = captured.get(name, [])
        tensors = all(isinstance(v, torch.Tensor) for v in values)
        out[name] = (
            torch.cat(values) if values and tensors and len(values) > 1 else (values[0] if values else None)
        )
    return out
