"""Objects from config nodes: a node with `_target_` (an import path) is the object that target
makes from the node's other keys, as Hydra's `instantiate` makes it, without Hydra (the recipe is
built from plain data: a dict, a run's saved `config.yaml`, or what Hydra composed).

    {_target_: torch.optim.AdamW, _partial_: true, lr: 0.001}   -> functools.partial(AdamW, lr=0.001)
    {_target_: transformers.LlamaConfig, hidden_size: 64}        -> LlamaConfig(hidden_size=64)

`_partial_: true` makes a partial, `_args_` gives positional arguments, nested nodes with a
`_target_` are made first (`_recursive_: false` leaves them as they are). A target that cannot
be imported, an argument it does not take and a value of the wrong type for an annotated
parameter are one line naming the key (`model.hiden: MLP takes no argument hiden`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from framework.errors import ConfigError

SPECIAL = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")


def locate(path: str, key: str = "_target_") -> Any:
    """The object at the import path `path` (`pkg.module.Class.attr`), read as Python reads it:
    an attribute where the object so far has one (a package's own `chars` function before its
    `chars` module), else the submodule; a ConfigError naming `key` when there is none."""
    parts = [p for p in str(path).split(".") if p]
    if not parts:
        raise ConfigError(f"{key}={path!r}: not an import path")
    try:
        found: Any = importlib.import_module(parts[0])
        for depth in range(1, len(parts)):
            try:
                found = getattr(found, parts[depth])
            except AttributeError:
                found = importlib.import_module(".".join(parts[: depth + 1]))
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{key}={path} cannot be imported: {exc}; check the module path and name") from None
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the module itself fails on import
        raise ConfigError(f"{key}={path} cannot be imported: {type(exc).__name__}: {exc}") from None
    return found


def is_target(node: Any) -> bool:
    """True for a node that names a `_target_`."""
    return isinstance(node, Mapping) and node.get("_target_") is not None


def instantiate(node: Any, key: str = "node") -> Any:
    """The object `node` describes (see the module doc); plain values as they are. `key` is the
    node's place in the config, for errors."""
    if isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        return [instantiate(item, f"{key}[{i}]") for i, item in enumerate(node)]
    if not isinstance(node, Mapping):
        return node
    recursive = node.get("_recursive_", True) is not False
    items = {k: v for k, v in node.items() if k not in SPECIAL}
    if recursive:
        items = {k: instantiate(v, f"{key}.{k}") for k, v in items.items()}
    if not is_target(node):
        return items
    target = locate(str(node["_target_"]), f"{key}._target_")
    args = [instantiate(a, f"{key}._args_") if recursive else a for a in node.get("_args_") or []]
    check_arguments(target, items, key)
    if node.get("_partial_"):
        return functools.partial(target, *args, **items)
    try:
        return target(*args, **items)
    except ConfigError as exc:
        if exc.option is None:
            raise
        raise ConfigError(exc.at(key)) from None


_WORDS = {int: "an integer", float: "a number", bool: "true or false"}


def check_arguments(target: Any, kwargs: dict[str, Any], key: str) -> None:
    """Every keyword `target` is given is one it takes, and a string is not given where an
    annotated number or flag is expected (what torch would report from deep inside)."""
    name = getattr(target, "__name__", str(target))
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for item in kwargs:
        if item not in params and not takes_any:
            import difflib

            close = difflib.get_close_matches(item, list(params), n=1)
            hint = (
                f"; did you mean {key}.{close[0]}?" if close else f"; it takes {', '.join(params) or 'none'}"
            )
            raise ConfigError(f"{key}.{item}: {name} takes no argument {item}{hint}")
    try:
        hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - no usable annotations: nothing to say
        return
    for item, value in kwargs.items():
        expected = hints.get(item)
        if expected in _WORDS and isinstance(value, str):
            raise ConfigError(f"{key}.{item}={value}: {name} takes {_WORDS[expected]} for {item}")
