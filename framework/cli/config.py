"""The schema of `conf/train.yaml` in Hydra's ConfigStore: the recipe's own dataclasses
(`framework.recipe.schema.RunConfig`, the API's option classes inside it), registered, not copied.

Hydra merges the YAML files onto them, so a typo'd key (`trainer.epoch=3`) or a wrong type
(`trainer.batch_size=big`) fails at composition; `check_override` says it in one line before
Hydra parses the command line. Groups whose options are arbitrary `_target_` objects (model,
optimizer, ...) are `Any`: their keys are checked against the target's signature when they are
made. A training method's options (`objective`) are its own dataclass, registered per method.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from framework.errors import ConfigError
from framework.methods import registered
from framework.process import slurm
from framework.recipe.schema import RunConfig

# Config groups chosen in train.yaml's defaults list. `+group=x` and `group=x` both select an
# option of these (see framework.cli.argv.normalize).
GROUPS = (
    "model",
    "data",
    "strategy",
    "optimizer",
    "scheduler",
    "trainer",
    "loss",
    "metrics",
    "logger",
    "callbacks",
    "experiment",
    "hparams_search",
    "autotune",
    "objective",
    "adapter",
)


def register_configs() -> None:
    """Register the schema so `train.yaml` can name it first in its defaults list, and each
    training method's options as the schema of its `conf/objective/NAME.yaml` (which names it
    first in its defaults list: `- /objective_options/NAME@_here_`; a group of its own, so the
    schemas are not offered as options of `objective`)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=RunConfig)
    for name, method in registered().items():
        cs.store(group="objective_options", name=name, node=method_node(name, method))
    # conf/hydra/launcher/slurm.yaml: request GPUs only for a run that uses them
    OmegaConf.register_new_resolver("slurm_gpus", slurm.gpus_per_node, replace=True)
    # ${project_dir:}: the checkout holding train.py, conf/ and examples/ (shipped example files by path)
    OmegaConf.register_new_resolver(
        "project_dir", lambda: str(Path(__file__).resolve().parents[2]), replace=True
    )


def method_node(name: str, method: Any) -> type:
    """The schema of a method's `objective` node: its options dataclass and its `name`."""
    return dataclasses.make_dataclass(
        f"{method.Config.__name__}Node",
        [("name", str, dataclasses.field(default=name))],
        bases=(method.Config,),
    )


def schema_field(path: list[str]) -> tuple[Any, str] | None:
    """(type, dotted prefix) of the schema field at `path`, or None when the path leaves the
    typed part of the schema (an `Any` node such as model or optimizer)."""
    import dataclasses
    import typing

    node: Any = RunConfig
    for depth, part in enumerate(path):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            import difflib

            prefix = ".".join(path[:depth])
            close = difflib.get_close_matches(part, list(hints), n=1)
            full = f"{prefix}.{part}" if prefix else part
            hint = f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown config key '{full}'; {hint}valid keys here: {', '.join(hints)}")
        node = hints[part]
    return node, ".".join(path)


_SCALARS = {int: "an integer", float: "a number", bool: "true or false"}


def check_override(item: str) -> None:
    """Reject an override of the typed schema (trainer.*, data.*, strategy.*, ...) whose key does
    not exist (naming the nearest) or whose value has the wrong type, before Hydra parses it."""

    key, sep, value = item.lstrip("+~").partition("=")
    if not sep or "/" in key or key.startswith("hydra") or key in GROUPS:
        return
    parts = key.split(".")
    if parts[0] not in ("trainer", "data", "strategy") or len(parts) < 2:
        return
    found = schema_field(parts)
    if found is None:
        return
    field_type, full = found
    optional = typing_optional(field_type)
    scalar = optional or field_type
    if scalar not in _SCALARS or any(ch in value for ch in ",()[]{}$*") or (optional and value == "null"):
        return
    try:
        if scalar is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
        else:
            scalar(value)
    except ValueError:
        raise ConfigError(f"{full}={value}: expected {_SCALARS[scalar]}") from None


def typing_optional(tp: Any) -> Any:
    """X for `X | None`, else None."""
    import typing

    args = typing.get_args(tp)
    if len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None
