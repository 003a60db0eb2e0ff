"""The config tree as plain data, checked against its schema before anything is built.

`plain(config)` takes what a user has: a dict, an OmegaConf object (what Hydra composed, or a run's
saved `config.yaml` loaded with `OmegaConf.load`; read through its mapping interface, so its
interpolations resolve), and gives nested dicts and lists. `check(tree)` rejects a key the schema
does not know (naming the nearest), a value out of its range, and a missing value, each in one
line naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from framework.errors import ConfigError
from framework.recipe.schema import MISSING, RENAMED, RunConfig

# The smallest value each numeric key accepts (a float bound is exclusive); null stays allowed
# where the schema allows it. Checked with the schema, so a value that would crash mid-run
# (a division by valid_freq, a slice by keep_last_k) stops the run before it starts.
MINIMUM: dict[str, int | float] = {
    "trainer.epochs": 1,
    "trainer.max_steps": 1,
    "trainer.steps_per_epoch": 1,
    "trainer.batch_size": 1,
    "trainer.valid_batch_size": 1,
    "trainer.valid_steps": 1,
    "data.shuffle_window": 0,
    "trainer.valid_freq": 1,
    "trainer.valid_every": 1,
    "trainer.devices": 1,
    "trainer.log_freq": 1,
    "trainer.log_every": 1,
    "trainer.timeout_s": 5,  # seconds: a rank's start-up alone can take longer than less
    "trainer.checkpoint.save_freq": 0,
    "trainer.checkpoint.every_n_steps": 0,
    "trainer.checkpoint.keep_last_k": 0,
    "trainer.checkpoint.grace_s": 0.0,
    "data.num_workers": 0,
    "data.prefetch": 0,
    "strategy.gradient_clip.max_norm": 0,
    "autotune.memory_gb": 0.0,
    "autotune.margin": 0.0,
    "autotune.trial_steps": 2,
    "autotune.warmup_steps": 1,
    "autotune.target.devices": 1,
    "autotune.target.memory_gb": 0.0,
}


def plain(config: Any, key: str = "") -> Any:
    """`config` as nested dicts and lists (see the module doc); a missing mandatory value
    (`???`) is one line naming its key."""
    if isinstance(config, Mapping):
        out = {}
        for k in config:
            name = f"{key}.{k}" if key else str(k)
            try:
                value = config[k]
            except Exception as exc:  # noqa: BLE001 - OmegaConf's MissingMandatoryValue and kin
                raise ConfigError(_unreadable(name, exc)) from None
            out[str(k)] = plain(value, name)
        return out
    if isinstance(config, Sequence) and not isinstance(config, (str, bytes)):
        return [plain(v, f"{key}[{i}]") for i, v in enumerate(config)]
    return config


def _required(key: str) -> str:
    return f"{key} is required: give it (e.g. {key}=VALUE on the command line)"


def _unreadable(key: str, exc: Exception) -> str:
    if type(exc).__name__ == "MissingMandatoryValue":
        return _required(key)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{key}: {first}"


def select(tree: dict[str, Any], key: str, default: Any = None) -> Any:
    """The value at the dotted `key` of `tree`, or `default` where a part is missing."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def check(tree: dict[str, Any]) -> None:
    """Keys the schema knows, values in range, nothing required left missing (see the module doc)."""
    check_ranges(tree)
    check_keys(tree, RunConfig)
    for key in ("model", "data.dataset"):
        if select(tree, key, MISSING) == MISSING:
            raise ConfigError(f"{key} is required: choose one ({key.split('.')[0]}=...) or give its _target_")
    missing = _first_missing(tree)
    if missing is not None:
        raise ConfigError(_required(missing))


def _first_missing(node: Any, key: str = "") -> str | None:
    """The key of the first value left `???` (a config resolved to plain data keeps OmegaConf's
    marker as a string: `model.path` of model=hf_causal_lm), or None."""
    if isinstance(node, dict):
        children: Any = ((f"{key}.{k}" if key else str(k), v) for k, v in node.items())
    elif isinstance(node, list):
        children = ((f"{key}[{i}]", v) for i, v in enumerate(node))
    else:
        return key if isinstance(node, str) and node == MISSING else None
    return next((found for name, value in children if (found := _first_missing(value, name))), None)


def check_ranges(tree: dict[str, Any]) -> None:
    """Every key of `MINIMUM` within its range (and finite), or a ConfigError naming it."""
    for key, low in MINIMUM.items():
        value = select(tree, key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        bad = not math.isfinite(value) or (value <= low if isinstance(low, float) else value < low)
        if bad:
            bound = f"> {low:g}" if isinstance(low, float) else f">= {low}"
            raise ConfigError(f"{key}={value}: must be a finite number {bound}")


def check_keys(node: Any, schema: type, prefix: str = "") -> None:
    """Reject keys `schema` (a dataclass) does not know, naming the nearest valid key, in `node`
    and its typed sub-nodes."""
    if not isinstance(node, Mapping):
        return
    known = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        name = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown config key '{name}'; {hint}valid keys: {', '.join(known)}")
        sub = dataclass_of(schema, str(key))
        if sub is not None:
            check_keys(node[key], sub, prefix=f"{name}.")


def dataclass_of(schema: type, name: str) -> type | None:
    """The dataclass type of `schema`'s field `name` (also inside `X | None`), or None."""
    hint = typing.get_type_hints(schema).get(name)
    options = [hint, *typing.get_args(hint)]
    return next((c for c in options if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def renamed(tree: dict[str, Any], old: str, say: bool = True) -> Any:
    """The value of the key `old` was renamed to (`RENAMED`); `old` itself wins when set, with a
    one-line deprecation (`say`: this process is the one that says it)."""
    value = select(tree, old)
    if value is None:
        return select(tree, RENAMED[old])
    if say:
        print(f"{old} is deprecated: use {RENAMED[old]} (same meaning)", flush=True)
    return value
