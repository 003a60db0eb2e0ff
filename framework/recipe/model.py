"""The model node as arguments of the framework's one model builder
(`framework.engine.construct`: build -> adapt -> partition, whole or partitioned under ZeRO-3).

This module only says what the node means: the factory (the node made by
`framework.recipe.targets`), its build on the meta device (for a `path` directory of a Hugging
Face model, its config.json's architecture, never read from the weight files), and whether
transformers builds it (its own ZeRO-3 path). The model's class is imported here, before any
`zero.Init` is entered (transformers' first import inside it fails).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import torch

from framework.backend.runtime import Runtime
from framework.engine import construct
from framework.errors import ConfigError
from framework.integrations import hf
from framework.integrations.hf_models import BUILDS_HF_MODELS
from framework.recipe.targets import instantiate, locate


def _target(node: Any) -> Any:
    """The object `_target_` names, imported now (outside any `zero.Init`)."""
    try:
        return locate(str(node["_target_"]), "model._target_")
    except ConfigError:
        return None  # made below, where the error names the key


def meta_model(node: dict[str, Any]) -> Any:
    """The model built on the meta device (shapes only: no memory, the random generators
    untouched): the model itself, or for a `path` directory of a Hugging Face model, its
    config.json's architecture (never read from the weight files)."""
    path = node.get("path")
    config_file = Path(str(path)) / "config.json" if path else None
    if config_file is not None and config_file.is_file():
        with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return hf.model_from_config_dir(config_file.parent, strict=False)
    return construct.on_meta(functools.partial(instantiate, node, "model"))


def count_parameters(node: dict[str, Any]) -> int:
    """Parameters the model will have (`meta_model`)."""
    return sum(p.numel() for p in meta_model(node).parameters())


def _factory(node: dict[str, Any], target: Any) -> Any:
    """The node made; for a transformers model class given with its config, inside
    transformers' ZeRO-3 path, its `_from_config` (which initialises it there)."""

    def make() -> Any:
        if not (hf.is_hf_model_class(target) and hf.zero3_enabled()):
            return instantiate(node, "model")
        kwargs = {k: instantiate(v, f"model.{k}") for k, v in node.items() if not k.startswith("_")}
        return target._from_config(kwargs.pop("config"), **kwargs)

    return make


def build_model(node: dict[str, Any], runtime: Runtime, adapter: Any = None) -> Any:
    """The model `node` describes, built as `strategy.sharding.init` says and adapted with
    `adapter` (an `AdapterConfig` or a `peft` config), by `framework.engine.construct.build_model`."""
    target = _target(node)
    transformers = hf.is_hf_model_class(target) or bool(getattr(target, BUILDS_HF_MODELS, False))
    return construct.build_model(
        _factory(node, target),
        runtime,
        adapter=adapter,
        meta=functools.partial(meta_model, node),
        transformers=transformers,
    )
