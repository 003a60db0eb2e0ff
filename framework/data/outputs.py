"""Model outputs and batches of every usual shape: tensors, tuples, dicts, Hugging Face
`ModelOutput`s and `BatchEncoding`s.

* `call_model` feeds a batch the way the model expects it: `model(*inputs)` for a tuple/list
  batch (its last element is the labels), `model(**batch)` for a dict batch (`label_key` names
  the labels); with the model's own loss (`ModelLoss`), the labels go in as `labels=`.
* `logits_of` picks what a loss or metric reads from the outputs: `output_key` of a dict /
  ModelOutput (default `logits`, else the first tensor), the first element of a tuple.
* `take` / `concat` / `interleave` keep the structure while slicing samples, so padding is
  trimmed from every tensor field and predictions come back in dataset order as they came out.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from framework.errors import ConfigError


class ModelLoss:
    """`loss=model`: use the loss the model computes itself from `labels=` (Hugging Face style),
    i.e. `outputs.loss`; no loss function needed."""

    def __repr__(self) -> str:
        return "ModelLoss()"


def is_model_loss(loss: Any) -> bool:
    """True for the `loss=model` marker (the object, or the string "model")."""
    return isinstance(loss, ModelLoss) or loss == "model"


def split(batch: Any, label_key: str = "labels") -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """(positional inputs, keyword inputs, labels) of a batch: the last element of a tuple/list is
    the labels; a dict's `label_key` entry is; a lone tensor is all inputs."""
    if isinstance(batch, Mapping):
        kwargs = {k: v for k, v in batch.items() if k != label_key}
        return (), kwargs, batch.get(label_key)
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return (batch[0],), {}, None
        return tuple(batch[:-1]), {}, batch[-1]
    return (batch,), {}, None


def call_model(
    model: Callable[..., Any],
    batch: Any,
    label_key: str = "labels",
    own_loss: bool = False,
    no_cache: bool = False,
) -> tuple[Any, Any]:
    """(outputs, labels) of one forward pass; with `own_loss` the labels are passed as `labels=`,
    with `no_cache` `use_cache=False` unless the batch sets it (see `takes_use_cache`)."""
    args, kwargs, labels = split(batch, label_key)
    if no_cache and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    if not own_loss or labels is None:
        return model(*args, **kwargs), labels
    try:
        return model(*args, **kwargs, labels=labels), labels
    except TypeError as exc:
        if "unexpected keyword argument 'labels'" not in str(exc):
            raise
        raise ConfigError(
            f"loss=model needs a model that takes labels= and returns its loss (a Hugging Face model), "
            f"but {str(exc).split('(')[0]} does not: configure a loss function instead (e.g. "
            "loss=cross_entropy, or loss=lm for next-token logits)"
        ) from None


@functools.cache  # per model class: asked on every evaluation and prediction batch
def _has_use_cache(cls: type) -> bool:
    try:
        return "use_cache" in inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def takes_use_cache(module: Any) -> bool:
    """True for a model whose forward has a `use_cache` parameter (Hugging Face models that return
    their key/value cache, a device-sized object per batch, unless told not to)."""
    return _has_use_cache(module.__class__)


def _fields(outputs: Any) -> Mapping[str, Any] | None:
    if isinstance(outputs, Mapping):
        return outputs
    if hasattr(outputs, "keys") and hasattr(outputs, "__getitem__"):  # ModelOutput is an OrderedDict
        return {k: outputs[k] for k in outputs.keys()}
    return None


def logits_of(outputs: Any, output_key: str | None = None) -> Any:
    """What a loss or metric reads: a tensor as is; `output_key` (default `logits`, else the first
    tensor) of a dict / ModelOutput; the first element of a tuple / list."""
    fields = _fields(outputs)
    if fields is not None:
        if output_key is not None:
            if output_key not in fields:
                raise ConfigError(
                    f"trainer.output_key={output_key}: the model's {type(outputs).__name__} has no such field; "
                    f"use one of: {', '.join(map(str, fields))}"
                )
            return fields[output_key]
        if "logits" in fields:
            return fields["logits"]
        return next((v for v in fields.values() if isinstance(v, torch.Tensor)), outputs)
    if isinstance(outputs, (tuple, list)) and outputs:
        return outputs[0]
    return outputs


def model_loss(outputs: Any) -> torch.Tensor:
    """The loss a model computed itself (`outputs.loss` / `outputs["loss"]` / a first tuple item)."""
    fields = _fields(outputs)
    loss = fields.get("loss") if fields is not None else getattr(outputs, "loss", None)
    if (
        loss is None
        and isinstance(outputs, (tuple, list))
        and outputs
        and isinstance(outputs[0], torch.Tensor)
    ):
        loss = outputs[0] if outputs[0].dim() == 0 else None
    if loss is None:
        raise ConfigError(
            f"loss=model, but the model returned a {type(outputs).__name__} without a loss: it needs a model "
            "that computes its loss from labels= (a Hugging Face model) and labels in the batch "
            "(data.label_key), or configure a loss function (e.g. loss=cross_entropy)"
        )
    return loss


def map_tensors(fn: Callable[[torch.Tensor], Any], outputs: Any) -> Any:
    """`outputs` with `fn` applied to every tensor, the structure (and its type) kept."""
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    fields = _fields(outputs)
    if fields is not None:
        mapped = {k: map_tensors(fn, v) for k, v in fields.items()}
        return _rebuild(outputs, mapped)
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(map_tensors(fn, v) for v in outputs)
    return outputs


def _rebuild(original: Any, fields: dict[str, Any]) -> Any:
    try:
        return (
            type(original)(**fields)
            if not isinstance(original, dict) or type(original) is not dict
            else fields
        )
    except TypeError:
        return fields


def take(outputs: Any, count: int) -> Any:
    """The first `count` samples of every tensor field (0-dim tensors, e.g. a loss, kept as they are)."""
    return map_tensors(lambda t: t[:count] if t.dim() else t, outputs)


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch (the leading dimension of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    fields = _fields(batch)
    if fields is not None:
        first = next((v for v in fields.values() if isinstance(v, torch.Tensor) and v.dim()), None)
        return batch_size_of(first) if first is not None else 1
    if isinstance(batch, (tuple, list)) and batch:
        return batch_size_of(batch[0])
    return 1


def concat(parts: list[Any]) -> Any:
    """One structure from several with the same layout: tensors concatenated along dim 0."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    fields = _fields(first)
    if fields is not None:
        return _rebuild(first, {k: concat([_fields(p)[k] for p in parts]) for k in fields})  # type: ignore[index]
    if isinstance(first, (tuple, list)):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    return first


def interleave(shards: list[Any], total: int) -> Any:
    """Dataset order from evaluation shards: rank r of N held samples r, r + N, r + 2N, ..."""
    present = [(r, s) for r, s in enumerate(shards) if s is not None]
    dp = len(shards)
    first = present[0][1]
    if isinstance(first, torch.Tensor):
        if not first.dim():
            return first
        out = first.new_empty((total, *first.shape[1:]))
        for r, shard in present:
            out[r : r + len(shard) * dp : dp] = shard
        return out
    fields = _fields(first)
    if fields is not None:
        field_shards = [_fields(s) for s in shards]
        return _rebuild(
            first, {k: interleave([f[k] if f else None for f in field_shards], total) for k in fields}
        )
    if isinstance(first, (tuple, list)):
        return type(first)(
            interleave([s[i] if s is not None else None for s in shards], total) for i in range(len(first))
        )
    return first


def split_samples(outputs: Any, size: int) -> list[Any]:
    """`outputs` cut into consecutive pieces of `size` samples (the structure kept in each)."""
    n = batch_size_of(outputs)
    return [map_tensors(functools.partial(_rows, start=i, stop=i + size), outputs) for i in range(0, n, size)]


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t[start:stop] if t.dim() else t
