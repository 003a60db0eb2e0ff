"""Where a run meets Hugging Face conventions between its data and its model.

* A dataset target may return `Splits(train, valid)` or a `datasets.DatasetDict` (its `train`
  and `validation` / `valid` / `test` splits): `as_splits`.
* A model loaded from a `save_pretrained` directory brings its tokenizer when the data names
  none: `tokenizer_dir`.
* Data made with a tokenizer is checked against the model's vocabulary, and classification
  labels become the model's `id2label` / `label2id`: `adopt`.
* The tokenizer's files are kept beside the checkpoints, where `export --hf` finds them:
  `keep_tokenizer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from framework.backend.weights import is_hf_model
from framework.data.datasets.classification import Splits
from framework.errors import ConfigError
from framework.process import context as dev

TOKENIZER_DIR = "tokenizer"  # in a checkpoints dir: the files of the tokenizer the run trained with
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_MODEL_DIR_KEYS = ("path", "pretrained_model_name_or_path")
_VALID_NAMES = ("validation", "valid", "test")


def as_splits(data: Any) -> Splits:
    """`Splits` from what a dataset target returned (see the module doc)."""
    if isinstance(data, Splits):
        return data
    keys = list(data.keys()) if hasattr(data, "keys") else None
    if keys is not None and "train" in keys:
        valid = next((name for name in _VALID_NAMES if name in keys), None)
        if valid is None:
            raise ConfigError(
                f"data.dataset returned splits {keys}: name one 'validation' (or 'valid' / 'test'), "
                "or return framework.data.datasets.Splits(train, valid)"
            )
        return Splits(_torch_rows(data["train"]), _torch_rows(data[valid]))
    raise ConfigError(
        f"data.dataset returned a {type(data).__name__}: a dataset target returns "
        "framework.data.datasets.Splits(train, valid) or a datasets.DatasetDict with a 'train' split"
    )


def _torch_rows(dataset: Any) -> Any:
    """A `datasets.Dataset` without a format gives tensors (lists would not batch)."""
    if hasattr(dataset, "with_format") and getattr(dataset, "format", {}).get("type") is None:
        return dataset.with_format("torch")
    return dataset


def model_dir(model_node: Any) -> Path | None:
    """The `save_pretrained` directory a model config loads from (`path=` or
    `pretrained_model_name_or_path=`), if it names one that exists."""
    for key in _MODEL_DIR_KEYS:
        value = model_node.get(key) if hasattr(model_node, "get") else None
        if isinstance(value, str) and Path(value).expanduser().is_dir():
            return Path(value).expanduser()
    return None


def tokenizer_dir(model_node: Any) -> Path | None:
    """The model's directory when it holds a tokenizer's files, else None."""
    path = model_dir(model_node)
    return path if path is not None and any((path / f).is_file() for f in _TOKENIZER_FILES) else None


def _hf_model(module: Any) -> Any:
    if is_hf_model(module):
        return module
    return next((m for m in module.modules() if is_hf_model(m)), None)


def check_vocabulary(model: Any, tokenizer: Any) -> None:
    """A tokenizer that gives ids past the model's embedding is a one-line error naming both sizes."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    size = len(tokenizer)
    if isinstance(vocab, int) and size > vocab:
        raise ConfigError(
            f"the tokenizer has {size} tokens but {type(model).__name__}'s vocabulary has {vocab} "
            f"(config.vocab_size): ids >= {vocab} would index past its embedding; use the model's own "
            "tokenizer (data.dataset.tokenizer=DIR) or a model with a vocabulary of at least "
            f"{size}"
        )


def set_labels(model: Any, labels: list[str]) -> None:
    """The data's class names as the model's `id2label` / `label2id` (saved with its config); a
    model with another number of classes is a one-line error."""
    config = model.config
    count = int(getattr(config, "num_labels", 0))
    named = labels != [str(i) for i in range(len(labels))]
    if count < len(labels) or (named and count != len(labels)):
        raise ConfigError(
            f"the data has {len(labels)} classes ({', '.join(labels[:5])}{', ...' if len(labels) > 5 else ''}) "
            f"but {type(model).__name__} has num_labels={count}: set model.num_labels={len(labels)}"
        )
    if named:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}


def adopt(module: Any, splits: Any) -> None:
    """Check the data's tokenizer against the model and give it the data's class names (see the
    module doc); nothing for a model that is not a Hugging Face one, or data without them."""
    model = _hf_model(module)
    if model is None:
        return
    tokenizer = getattr(splits, "tokenizer", None)
    if tokenizer is not None:
        check_vocabulary(model, tokenizer)
    labels = getattr(splits, "labels", None)
    if labels is not None:
        set_labels(model, labels)


def keep_tokenizer(splits: Any, ckpt_dir: Path) -> Path | None:
    """Rank 0 writes the data's tokenizer (one that has files: `save_pretrained`) into
    `ckpt_dir/tokenizer`, for `export --hf`."""
    tokenizer = getattr(splits, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return None
    out = ckpt_dir / TOKENIZER_DIR
    if dev.is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))
    return out
