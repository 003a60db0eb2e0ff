"""Step flavours, the default steps, and what a step's result means.

* batch step      ``step(engine, batch)``: the default (`loss(model(*inputs), labels)`), or a
                  model's ``training_step(batch)`` / ``validation_step`` / ``predict_step``.
* iterator step   any step with a parameter named ``dataloader_iter``: it pulls 0, 1 or many
                  batches per call from a `framework.data.BatchIterator`, which counts every
                  fetch (progress, logs, exact resume) and hands out batches already on the
                  device, prefetched in the background.

A training step returns a loss tensor (the framework does backward + optimizer step), a dict
of metrics (the step drove `engine.backward` / `engine.step` itself), or None (nothing to log).
Steps get the `Engine` as their first argument; this module only relies on what a step may use
of it (`model`, `module`, `runtime`, `loss`, `metrics`, `label_key`, `output_key`,
`backward_and_step`).

A step object (or the object a step method belongs to) may measure more than the loss: the
loop logs what its `step_logs(device)` returns at each logging point, and evaluation what its
`eval_logs(device)` returns at the end (as val_...); both are collective, every rank calls them.
What such a window holds survives a checkpoint through `step_state()` (plain data, CPU tensors)
and `load_step_state(states, device)`. A step object whose loss averages over items of the whole
global batch (tokens) says what they are with `items(batch)`, and is then called with its
micro-batch's weight: `step(engine, batch, weight)`. The training methods of `framework.methods`
are such objects; their full protocol (`attach`, `prepare_data`, `weights_loaded`) is in
`framework.methods.base`.

The default steps call a model that can return its key/value cache (a Hugging Face model's
`use_cache`) with `use_cache=False` unless the batch sets it: evaluation and prediction keep
outputs, so a cache per batch would pile up on the device, and in training a cache serves nothing
and hides packed sequences (position ids that restart per document) from the model's attention,
which then runs across documents.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from framework.backend import sequence_parallel
from framework.data.outputs import (
    batch_size_of,
    call_model,
    is_model_loss,
    logits_of,
    map_tensors,
    model_loss,
    split,
    take,
    takes_use_cache,
)
from framework.errors import ConfigError
from framework.integrations.hf import predicts_next_token

ITERATOR_ARG = "dataloader_iter"


def takes_iterator(fn: Callable[..., Any]) -> bool:
    """True when `fn` is an iterator-consuming step (has a `dataloader_iter` parameter)."""
    try:
        return ITERATOR_ARG in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def owner(step_fn: Any) -> Any:
    """What a step's extra methods (`step_logs`, `eval_logs`, `step_state`) live on: the object a
    bound step method belongs to (`dpo.eval_step`), else the step itself."""
    return getattr(step_fn, "__self__", step_fn)


def method_eval_step(train_step: Any) -> Callable[..., Any] | None:
    """The validation step a training step object brings (a method's `eval_step`), or None."""
    found = getattr(train_step, "eval_step", None)
    return found if callable(found) and not inspect.ismethod(train_step) else None


def attach_method(engine: Any) -> None:
    """Let the engine's training step, when it is a method object with `attach`, set itself up
    for this engine before DeepSpeed is built (`framework.methods.base`)."""
    attach = getattr(engine.train_step_fn, "attach", None)
    if callable(attach):
        attach(engine)


def counter_of(step_fn: Any) -> Callable[[Any], Any] | None:
    """A step object's `items(batch)` (what its loss averages over, counted by the framework over
    the global batch, `framework.engine.items`), or None: the step is then called with its
    micro-batch's `weight` as a third argument."""
    items = getattr(step_fn, "items", None)
    return items if callable(items) and not takes_iterator(step_fn) else None


def bind_step(step_fn: Callable[..., Any]) -> Callable[[Any, Iterator[Any]], Any]:
    """`step_fn` as one call on an iterator of batches, its flavour decided once: an iterator
    step gets the iterator, a batch step the iterator's next batch."""
    if takes_iterator(step_fn):
        return step_fn
    return lambda engine, batches: step_fn(engine, next(batches))


def resolve_step(
    user_step: Callable[..., Any] | None, module: torch.nn.Module, method: str
) -> Callable | None:
    """The step to use: an explicit one, else the model's `method` (training_step,
    validation_step, predict_step), else None (the framework's default step). A model method
    gets the engine as first argument like a free function does, so both are called as
    `step(engine, batch_or_iter)`."""
    if user_step is not None:
        return user_step
    bound = getattr(module, method, None)
    if not callable(bound):
        return None
    params = inspect.signature(bound).parameters
    if ITERATOR_ARG in params:
        return lambda engine, dataloader_iter: bound(dataloader_iter)
    if next(iter(params), None) == "engine":
        return bound
    return lambda engine, batch: bound(batch)


class LossFunction:
    """The configured loss, computed in float32 whatever the model's compute dtype, on what the
    outputs hold for it (`outputs.logits_of`: a tensor, the `output_key` / `logits` field of a
    dict or ModelOutput, a tuple's first element). A loss that fails on them is a ConfigError
    naming what it got."""

    def __init__(self, fn: Callable[..., torch.Tensor], output_key: str | None = None):
        self.fn, self.output_key = fn, output_key

    def __call__(self, outputs: Any, labels: Any) -> torch.Tensor:
        logits = logits_of(outputs, self.output_key)
        if isinstance(logits, torch.Tensor) and logits.is_floating_point():
            logits = logits.float()
        if isinstance(labels, torch.Tensor) and labels.is_floating_point():
            labels = labels.float()
        try:
            return self.fn(logits, labels)
        except (TypeError, AttributeError, ValueError, RuntimeError, IndexError) as exc:
            raise ConfigError(_cannot_read("the loss", self.fn, outputs, logits, labels, exc)) from None


def _shape(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _cannot_read(what: str, fn: Any, outputs: Any, logits: Any, labels: Any, exc: BaseException) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    source = "" if outputs is logits else f" from a {type(outputs).__name__}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"{what} {name} failed on the model's outputs ({_shape(logits)}{source}; labels {_shape(labels)}): "
        f"{first}. For next-token logits use loss=lm, to use the loss the model computes from labels= use "
        "loss=model, or set trainer.output_key to the output field to read"
    )


def update_metrics(engine: Any, metrics: Any, outputs: Any, labels: Any, aligned: bool = False) -> None:
    """Accumulate a batch's outputs into `metrics` (what the loss reads from them). With the
    model's own loss, a causal LM's logits are scored against the next position's label, as
    that loss does (`MetricSet.update` aligns them and leaves out ignored labels), unless the
    labels are `aligned` already (shifted by the sequence-parallel split)."""
    if labels is None or not len(metrics):
        return
    logits = logits_of(outputs, engine.output_key)
    shifted = is_model_loss(engine.loss) and predicts_next_token(engine.module) and not aligned
    try:
        metrics.update(logits, labels, shifted)
    except (TypeError, AttributeError, ValueError, RuntimeError, IndexError) as exc:
        raise ConfigError(
            _cannot_read("a metric", type(metrics.metrics[next(iter(metrics))]), outputs, logits, labels, exc)
        ) from None


def forward_loss(engine: Any, batch: Any) -> tuple[Any, Any, torch.Tensor | None]:
    """(outputs, labels, loss) of one batch: the model fed as the batch says (`model(*inputs)`,
    `model(**batch)`), the loss from the configured function or, with `loss=model`, from the
    model itself (its labels passed as `labels=`)."""
    own = is_model_loss(engine.loss)
    no_cache = takes_use_cache(engine.module)
    try:
        outputs, labels = call_model(engine.model, batch, engine.label_key, own, no_cache)
    except RuntimeError as exc:
        if "'indices'" not in str(exc):  # an embedding's lookup given anything but token ids
            raise
        raise ConfigError(
            f"{type(engine.module).__name__} looks up token ids in an embedding, but the data gives it "
            f"{_input_dtypes(batch, engine.label_key)} inputs: use token data (data=chars with loss=lm, data=hf_text, or "
            "experiment=hf_llama_chars), or a model for features (model=mlp)"
        ) from None
    if labels is None or engine.loss is None:
        return outputs, labels, None
    return outputs, labels, model_loss(outputs) if own else engine.loss(outputs, labels)


def _input_dtypes(batch: Any, label_key: str) -> str:
    found: list[str] = []
    args, kwargs, _ = split(batch, label_key)
    map_tensors(lambda t: found.append(str(t.dtype).removeprefix("torch.")), (args, kwargs))
    return "/".join(sorted(set(found))) or "non-tensor"


def default_train_step(
    engine: Any, batch: Any, weight: torch.Tensor | Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """The loss of one batch, updating the training metrics; times `weight`, the batch's share
    of its optimizer step's items (`framework.engine.items`), when the loss averages over items
    (a callable weight is read after the forward pass: its count may still be in flight). Under
    sequence parallelism, on this rank's slice of the batch (`framework.backend.sequence_parallel`)."""
    mesh, stage = engine.runtime.mesh, engine.runtime.strategy.sharding.stage
    if mesh.sp_size > 1:
        batch = sequence_parallel.training_batch(batch, mesh, engine.loss, engine.label_key)
    outputs, labels, loss = forward_loss(engine, batch)
    if loss is None:
        raise ConfigError(
            "the training batches carry no labels (the last element of a tuple, or data.label_key)"
        )
    update_metrics(engine, engine.metrics.train, outputs, labels, aligned=mesh.sp_size > 1)
    if weight is not None:
        loss = loss.float() * (weight() if callable(weight) else weight).to(loss.device)
    return sequence_parallel.gradient_share(loss, mesh, stage)


def default_eval_step(engine: Any, batch: Any, unpadded: int) -> tuple[Any, torch.Tensor | None]:
    """Forward one evaluation batch cut to its `unpadded` samples (a rank whose batch is all
    padding still runs the forward pass: ZeRO-3 gathers parameters collectively); the loss (a
    tensor) and the evaluation metrics over those samples."""
    size = batch_size_of(batch)
    if 0 < unpadded < size:
        batch = take(batch, unpadded)
    outputs, labels, loss = forward_loss(engine, batch)
    if unpadded == 0 or loss is None:
        return outputs, None
    update_metrics(engine, engine.metrics.eval, outputs, labels)
    return outputs, loss


def default_predict_step(engine: Any, batch: Any) -> Any:
    """The model's outputs for a batch (its labels, if any, left out; no key/value cache)."""
    no_cache = takes_use_cache(engine.module)
    outputs, _ = call_model(engine.model, batch, engine.label_key, own_loss=False, no_cache=no_cache)
    return outputs


def apply_train_result(engine: Any, result: Any) -> Any:
    """Act on what a training step returned and give back its loss, still on the device: a loss
    tensor is backpropagated and stepped; a dict (the step optimised itself) is only read; a
    float is a loss the pipeline engine already stepped on."""
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise ConfigError(
                f"the loss must be a scalar, got a tensor of shape {tuple(result.shape)}: reduce it "
                "(e.g. reduction='mean' in the loss, or .mean() in your step)"
            )
        engine.backward_and_step(result)
        return result.detach()
    if isinstance(result, dict):
        loss = result.get("loss")
        return loss.detach() if isinstance(loss, torch.Tensor) else loss
    if result is None or isinstance(result, float):
        return result
    raise TypeError(f"a training step must return a loss tensor, a dict or None, got {type(result).__name__}")
