"""Hugging Face models from a local directory or a config: no hub access.

    model=hf_causal_lm model.path=DIR     # fine-tune a save_pretrained directory
    model=hf_sequence_classification model.path=DIR model.num_labels=3   # a classifier
    model=hf_gpt2 / model=hf_llama        # tiny models built from a config (conf/model/)

Under ZeRO-3, when the model is built partitioned (see `framework.engine.construct`), transformers'
own ZeRO-3 path loads and initialises it (its `HfDeepSpeedConfig` is active while this runs):
`BUILDS_HF_MODELS` marks these factories for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from framework.errors import ConfigError

BUILDS_HF_MODELS = "builds_hf_model"  # the attribute that marks a factory of transformers models


def causal_lm(path: str | None = None, config: Any = None, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM` from `path` (a `save_pretrained` directory), or from `config` (a
    `PretrainedConfig`, or a dict with `model_type` and its settings). `kwargs` go to
    `from_pretrained` / `from_config` (e.g. `attn_implementation`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is not None:
        return AutoModelForCausalLM.from_pretrained(local_model_dir(path), local_files_only=True, **kwargs)
    if config is None:
        raise ValueError("hf_causal_lm needs model.path=DIR (a save_pretrained directory) or model.config")
    if isinstance(config, dict) or hasattr(config, "items") and not hasattr(config, "to_dict"):
        settings = dict(config)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def sequence_classification(
    path: str | None = None, config: Any = None, num_labels: int | None = None, **kwargs: Any
) -> Any:
    """`AutoModelForSequenceClassification` from `path` or `config` (as `causal_lm`), with
    `num_labels` classes when given (a directory's model with another number gets a new head)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if num_labels is not None:
        kwargs["num_labels"] = int(num_labels)
    if path is not None:
        if num_labels is not None:
            kwargs["ignore_mismatched_sizes"] = True  # a directory's model with another number: a new head
        return AutoModelForSequenceClassification.from_pretrained(
            local_model_dir(path), local_files_only=True, **kwargs
        )
    if config is None:
        raise ValueError("hf_sequence_classification needs model.path=DIR or model.config")
    if isinstance(config, dict) or hasattr(config, "items") and not hasattr(config, "to_dict"):
        settings = dict(config)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    if "num_labels" in kwargs:
        config.num_labels = kwargs.pop("num_labels")
    return AutoModelForSequenceClassification.from_config(config, **kwargs)


def local_model_dir(path: str | Path, key: str = "model.path") -> str:
    """`path` as a local `save_pretrained` directory, or a one-line error naming it and what it
    should hold. Checked before transformers sees it: a name that is not a directory is a hub id to
    transformers, which then retries the network for half a minute (nothing here downloads)."""
    found = Path(path).expanduser()
    if not found.is_dir():
        raise ConfigError(
            f"{key}={path}: no such directory (a local save_pretrained directory holding config.json; "
            "nothing is downloaded from the hub)"
        )
    if not (found / "config.json").is_file():
        raise ConfigError(f"{key}={path}: no config.json in it (a save_pretrained directory is expected)")
    return str(found)


for _factory in (causal_lm, sequence_classification):
    setattr(_factory, BUILDS_HF_MODELS, True)
