"""The model config node as arguments of the framework's one model builder
(`framework.engine.construct`: build -> adapt -> partition, whole or partitioned under ZeRO-3).

The CLI only says what the node means: the factory (`partial(instantiate, node)`), its build on
the meta device (for a `path` directory of a Hugging Face model, its config.json's architecture,
never read from the weight files), whether transformers builds it (its own ZeRO-3 path), and the
`adapter` node as a `peft` config. The model's class is imported here, before any `zero.Init`
is entered (transformers' first import inside it fails).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_object, instantiate

from framework.backend.runtime import Runtime
from framework.engine import construct
from framework.integrations import hf, peft
from framework.integrations.hf_models import BUILDS_HF_MODELS


def _target(node: Any) -> Any:
    """The object `_target_` names, imported now (outside any `zero.Init`)."""
    try:
        return get_object(str(node._target_))
    except Exception:  # noqa: BLE001 - instantiate reports it with the key
        return None


def meta_model(node: Any) -> Any:
    """The model built on the meta device (shapes only: no memory, the random generators
    untouched): the model itself, or for a `path` directory of a Hugging Face model, its
    config.json's architecture (never read from the weight files)."""
    path = node.get("path") if hasattr(node, "get") else None
    config_file = Path(str(path)) / "config.json" if path else None
    if config_file is not None and config_file.is_file():
        with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return hf.model_from_config_dir(config_file.parent, strict=False)
    return construct.on_meta(functools.partial(instantiate, node))


def count_parameters(node: Any) -> int:
    """Parameters the model will have (`meta_model`)."""
    return sum(p.numel() for p in meta_model(node).parameters())


def _factory(node: Any, target: Any) -> Any:
    """`instantiate(node)`; for a transformers model class given with its config, inside
    transformers' ZeRO-3 path, its `_from_config` (which initialises it there)."""

    def make() -> Any:
        if not (hf.is_hf_model_class(target) and hf.zero3_enabled()):
            return instantiate(node)
        kwargs = {
            k: instantiate(v) if hasattr(v, "_target_") else v for k, v in node.items() if k != "_target_"
        }
        return target._from_config(kwargs.pop("config"), **kwargs)

    return make


def adapter_config(node: Any) -> Any:
    """The `adapter` node (`+adapter=lora`) as a `peft` config; None without one."""
    if node is None:
        return None
    return peft.lora_config(**{str(k): v for k, v in node.items()})


def build_model(node: Any, runtime: Runtime, adapter: Any = None) -> Any:
    """The model `node` describes, built as `strategy.sharding.init` says and adapted with
    `adapter` (a `peft` config), by `framework.engine.construct.build_model`."""
    target = _target(node)
    transformers = hf.is_hf_model_class(target) or bool(getattr(target, BUILDS_HF_MODELS, False))
    return construct.build_model(
        _factory(node, target),
        runtime,
        adapter=adapter,
        meta=functools.partial(meta_model, node),
        transformers=transformers,
    )
