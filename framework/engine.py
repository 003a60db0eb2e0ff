"""`Engine`: Paddle-style `fit` / `evaluate` / `predict` on top of a DeepSpeed engine.

    engine = Engine(model, loss, optimizer, metrics, strategy=Strategy(sharding={"stage": 3}))
    history = engine.fit(train_ds, valid_data=valid_ds, epochs=2, batch_size=64)

`batch_size` is always the global batch, split over data-parallel ranks (and accumulation
steps for training). One DeepSpeed engine holds the weights for every mode.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from framework import data as data_lib
from framework import device as dev
from framework.callbacks import Callback, Event, TrainState
from framework.steps import BatchIterator, Prefetcher, resolve_step, takes_iterator
from framework.strategy import (
    BatchLayout,
    ConfigError,
    Strategy,
    batch_layout,
    compute_dtype_name,
    deepspeed_config,
)

MODES = ("train", "eval", "predict")


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of 'train', 'eval', 'predict'")
    return mode


def param_counts(module: nn.Module) -> tuple[int, int]:
    """(total parameters, largest single parameter) — ZeRO-3-partitioned parameters counted whole."""
    sizes = [int(getattr(p, "ds_numel", p.numel())) for p in module.parameters()]
    return sum(sizes), max(sizes, default=0)


def _metric_name(metric: Any) -> str:
    name = type(metric).__name__
    for prefix in ("Multiclass", "Multilabel", "Binary"):
        if name.startswith(prefix) and len(name) > len(prefix):
            name = name[len(prefix) :]
    return name.lower()


def _named_metrics(metrics: Any) -> dict[str, Any]:
    if metrics is None:
        return {}
    if isinstance(metrics, dict) or hasattr(metrics, "items"):
        return dict(metrics.items())
    if not isinstance(metrics, (list, tuple)):
        metrics = [metrics]
    return {_metric_name(m): m for m in metrics}


def model_init_context(
    strategy: Strategy, config: dict[str, Any] | None = None
) -> contextlib.AbstractContextManager:
    """Context to construct a model in: `deepspeed.zero.Init` under ZeRO-3 (parameters are born
    partitioned, never whole on one rank), nothing otherwise. The process group must exist."""
    if strategy.sharding.stage != 3 or strategy.uses_pipeline:
        return contextlib.nullcontext()
    import deepspeed

    # The dtype comes from the config's bf16/fp16 sections (passing dtype too makes DeepSpeed 0.19
    # pick bf16 on any accelerator without fp16).
    return deepspeed.zero.Init(config_dict_or_path=config)


class _Loss:
    """The configured loss, computed in float32 whatever the model's compute dtype."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn

    def __call__(self, outputs: Any, labels: Any) -> torch.Tensor:
        if isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
            outputs = outputs.float()
        if isinstance(labels, torch.Tensor) and labels.is_floating_point():
            labels = labels.float()
        return self.fn(outputs, labels)


class Engine:
    """Train, evaluate and predict with a model under a `Strategy`, on DeepSpeed.

    Args:
        model: the `nn.Module` to train.
        loss: `loss(outputs, labels) -> scalar`, e.g. `nn.CrossEntropyLoss()`.
        optimizer: a torch optimizer, a factory taking parameters (Hydra `_partial_`), or None
            when the strategy's raw `deepspeed` config names one.
        metrics: torchmetrics metric(s), a list or a {name: metric} dict.
        strategy: a `Strategy`, a dict of its sections, or None for plain data parallel.
        scheduler: a factory `scheduler(optimizer[, total_steps=N])` stepped once per optimizer step.
        train_step / eval_step: custom steps (see `framework.steps`); default: loss(model(x), y).
        callbacks: `Callback`s (loggers are callbacks too).
        seed: seed of the data shuffling.
        prefetch: batches kept ready on the device ahead of the step.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: Callable[..., torch.Tensor] | None = None,
        optimizer: Any = None,
        metrics: Any = None,
        strategy: Strategy | dict[str, Any] | None = None,
        *,
        scheduler: Callable[..., Any] | None = None,
        train_step: Callable[..., Any] | None = None,
        eval_step: Callable[..., Any] | None = None,
        callbacks: Iterable[Callback] | None = None,
        seed: int = 0,
        prefetch: int = 2,
    ):
        self.module = model
        self.model: Any = model  # the DeepSpeed engine once prepared: engine.model(x) runs the forward pass
        self.loss = _Loss(loss) if loss is not None else None
        self._optimizer_spec = optimizer
        self._scheduler_spec = scheduler
        self.metrics = _named_metrics(metrics)
        self.strategy = strategy if isinstance(strategy, Strategy) else Strategy(**(strategy or {}))
        self.train_step_fn = resolve_step(train_step, model, "training_step")
        self.eval_step_fn = resolve_step(eval_step, model, "validation_step")
        self.callbacks: list[Callback] = list(callbacks or [])
        self.seed = seed
        self.prefetch = prefetch
        self.ds_engine: Any = None
        self.deepspeed_config: dict[str, Any] | None = None
        self.layout: BatchLayout | None = None
        self.state = TrainState(engine=self)
        self._prepared: set[str] = set()
        self._total_steps: int | None = None
        self._float_dtype = getattr(torch, compute_dtype_name(self.strategy))

    # ------------------------------------------------------------------ setup
    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return dev.world_size()

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: processes / pipeline stages."""
        return max(1, self.world_size // self.strategy.pipeline.stages)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas."""
        return dev.rank() % self.dp_size

    def prepare(
        self,
        mode: str = "train",
        batch_size: int | None = None,
        inputs_spec: Any = None,
        labels_spec: Any = None,
    ) -> None:
        """Build the DeepSpeed engine for `mode` (once; again is a no-op). `batch_size` is global."""
        _check_mode(mode)
        if mode == "train" and (
            self.loss is None or (self._optimizer_spec is None and "optimizer" not in self.strategy.deepspeed)
        ):
            raise ConfigError("set optimizer and loss before training (Engine(model, loss, optimizer, ...))")
        if mode == "eval" and self.loss is None and self.eval_step_fn is None:
            raise ConfigError("set loss before evaluation (Engine(model, loss, ...))")
        dev.init_process_group()
        if self.ds_engine is None:
            self._build(
                batch_size or self.dp_size * self.strategy.accumulation_steps,
                with_optimizer=(mode == "train"),
            )
        elif mode == "train" and self.ds_engine.optimizer is None and self._optimizer_spec is not None:
            raise ConfigError(
                "this Engine was prepared for eval/predict first; prepare(mode='train') before the other modes"
            )
        self._prepared.add(mode)

    def _build(self, global_batch_size: int, with_optimizer: bool) -> None:
        import deepspeed

        dev.quiet_deepspeed()
        self.layout = batch_layout(self.strategy, global_batch_size, self.world_size)
        numel, largest = param_counts(self.module)
        self.deepspeed_config = deepspeed_config(
            self.strategy, global_batch_size, self.world_size, numel, largest
        )
        self.module.to(dev.device())
        optimizer = self._optimizer_spec if with_optimizer else None
        scheduler = self._scheduler_factory() if with_optimizer else None
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.ds_engine, _, _, _ = deepspeed.initialize(
            model=self.module,
            optimizer=optimizer,
            model_parameters=trainable if optimizer is None or callable(optimizer) else None,
            lr_scheduler=scheduler,
            config=self.deepspeed_config,
        )
        self.model = self.ds_engine
        for metric in self.metrics.values():
            metric.to(dev.device())
        if isinstance(self.loss, _Loss) and isinstance(self.loss.fn, nn.Module):
            self.loss.fn.to(dev.device())

    def _scheduler_factory(self) -> Callable[[Any], Any] | None:
        spec = self._scheduler_spec
        if spec is None:
            return None
        try:
            wants_total = "total_steps" in inspect.signature(spec).parameters
        except (TypeError, ValueError):
            wants_total = False
        if wants_total:
            total = self._total_steps or 1
            return lambda opt: spec(opt, total_steps=total)
        return spec

    def _transfer(self, batch: Any) -> Any:
        return dev.to_device(
            batch, dev.device(), self._float_dtype if self._float_dtype != torch.float32 else None
        )

    # ------------------------------------------------------------------ manual optimisation
    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass through DeepSpeed (for steps that drive optimisation themselves).

        Several `backward` calls before one `step` accumulate correctly under every ZeRO stage."""
        self.ds_engine.set_gradient_accumulation_boundary(False)
        self._pending_backward = getattr(self, "_pending_backward", 0) + 1
        self.ds_engine.backward(loss)

    def step(self) -> None:
        """Optimizer step after one or more `backward` calls."""
        self.ds_engine.set_gradient_accumulation_boundary(True)
        self.ds_engine.allreduce_gradients()
        self.ds_engine.step()
        self._pending_backward = 0

    def _auto_step(self, loss: torch.Tensor) -> None:
        self.ds_engine.backward(loss)
        self.ds_engine.step()

    @property
    def lr(self) -> float:
        """Current learning rate of the first parameter group."""
        opt = self.ds_engine.optimizer if self.ds_engine is not None else None
        if opt is None:
            return 0.0
        groups = getattr(opt, "param_groups", None) or []
        return float(groups[0]["lr"]) if groups else 0.0

    # ------------------------------------------------------------------ metrics
    def reset_metrics(self) -> None:
        """Clear accumulated metric state."""
        for metric in self.metrics.values():
            metric.reset()

    def _update_metrics(self, outputs: Any, labels: Any) -> None:
        if labels is None or not isinstance(outputs, torch.Tensor):
            return
        for metric in self.metrics.values():
            metric.update(outputs.detach().float(), labels)

    def compute_metrics(self, prefix: str = "") -> dict[str, float]:
        """Accumulated metric values (synced across ranks by torchmetrics), as floats."""
        out = {}
        for name, metric in self.metrics.items():
            if getattr(metric, "update_count", 1) == 0:
                continue
            value = metric.compute()
            out[prefix + name] = (
                float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            )
        return out

    # ------------------------------------------------------------------ the default step
    def default_train_step(self, batch: Any) -> torch.Tensor:
        """loss(model(*inputs), labels), updating the training metrics."""
        inputs, labels = data_lib.split_batch(batch)
        outputs = self.model(*inputs)
        assert self.loss is not None
        loss = self.loss(outputs, labels)
        self._update_metrics(outputs, labels)
        return loss

    # ------------------------------------------------------------------ fit
    def _fire(self, event: Event) -> None:
        for callback in self.callbacks:
            callback.on_event(event, self.state)

    def fit(
        self,
        train_data: Any,
        valid_data: Any = None,
        epochs: int = 1,
        batch_size: int = 1,
        steps_per_epoch: int | None = None,
        valid_freq: int = 1,
        log_freq: int = 10,
        max_steps: int | None = None,
        valid_batch_size: int | None = None,
        shuffle: bool = True,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        callbacks: Iterable[Callback] | None = None,
    ) -> dict[str, list[Any]]:
        """Train for `epochs` epochs (or until `max_steps` optimizer steps) and return the history:
        per-epoch lists of loss, lr, each metric and, when validating, val_loss and val_<metric>.

        `steps_per_epoch` caps optimizer steps per epoch; `log_freq` is in optimizer steps.
        """
        self.callbacks.extend(callbacks or [])
        dev.init_process_group()
        layout = batch_layout(self.strategy, batch_size, self.world_size)
        loader = data_lib.train_loader(
            train_data,
            layout.micro_batch_size,
            self.dp_size,
            self.dp_rank,
            shuffle,
            self.seed,
            collate_fn=collate_fn,
            num_workers=num_workers,
        )
        batches_per_epoch = len(loader)
        if steps_per_epoch is not None:
            batches_per_epoch = min(batches_per_epoch, steps_per_epoch * layout.accumulation_steps)
        steps_each_epoch = max(1, batches_per_epoch // layout.accumulation_steps)
        total = epochs * steps_each_epoch
        self._total_steps = min(total, max_steps) if max_steps else total
        self.prepare("train", batch_size)
        st = self.state
        st.epochs, st.max_steps, st.global_batch_size = epochs, max_steps, batch_size
        st.batches_per_epoch, st.history, st.stop_training = batches_per_epoch, {}, False
        start = time.perf_counter()
        self._fire(Event.FIT_START)
        for epoch in range(st.epoch, epochs):
            st.epoch = epoch
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            logs = self._train_epoch(loader, batches_per_epoch, log_freq)
            if valid_data is not None and (epoch + 1) % valid_freq == 0:
                val = self.evaluate(
                    valid_data, batch_size=valid_batch_size or batch_size, collate_fn=collate_fn
                )
                logs.update({("val_" + k if not k.startswith("val_") else k): v for k, v in val.items()})
                st.logs = dict(logs)
                self._fire(Event.VALIDATION_END)
            for key, value in logs.items():
                st.history.setdefault(key, []).append(value)
            st.logs = dict(logs, epoch=epoch + 1)
            st.elapsed_s = time.perf_counter() - start
            self._fire(Event.EPOCH_END)
            if st.stop_training:
                break
        st.elapsed_s = time.perf_counter() - start
        self._fire(Event.FIT_END)
        return st.history

    def _train_epoch(self, loader: Any, batches_per_epoch: int, log_freq: int) -> dict[str, Any]:
        st = self.state
        self.model.train()
        self.reset_metrics()
        st.batches_in_epoch = st.step_calls = 0
        self._fire(Event.EPOCH_START)
        samples_factor = self.dp_size

        def on_fetch(batch: Any) -> None:
            st.batches_in_epoch += 1
            st.batches_fetched += 1
            st.samples_seen += BatchIterator.samples_in(batch) * samples_factor

        source = Prefetcher(iter(loader), self._transfer, depth=self.prefetch)
        batches = BatchIterator(source, on_fetch, limit=batches_per_epoch)
        step_fn = self.train_step_fn
        iterator_step = step_fn is not None and takes_iterator(step_fn)
        epoch_loss, epoch_calls, window_loss, window_calls = 0.0, 0, 0.0, 0
        idle_calls = 0
        try:
            while not st.stop_training:
                if st.max_steps is not None and st.global_step >= st.max_steps:
                    st.stop_training, st.stop_reason = True, f"reached trainer.max_steps={st.max_steps}"
                    break
                fetched_before = batches.fetched
                steps_before = self.ds_engine.global_steps
                try:
                    if iterator_step:
                        result = step_fn(self, batches)  # type: ignore[misc]
                    else:
                        batch = next(batches)
                        result = (
                            step_fn(self, batch) if step_fn is not None else self.default_train_step(batch)
                        )
                except StopIteration:
                    break
                loss_value = self._consume_result(result)
                st.step_calls += 1
                if loss_value is not None:
                    epoch_loss += loss_value
                    window_loss += loss_value
                    epoch_calls += 1
                    window_calls += 1
                idle_calls = idle_calls + 1 if batches.fetched == fetched_before else 0
                if idle_calls > 10_000:
                    raise RuntimeError(
                        "the training step pulled no batch in 10000 consecutive calls; it never ends"
                    )
                st.global_step = self.ds_engine.global_steps
                stepped = st.global_step > steps_before
                st.log_now = stepped and st.global_step % max(1, log_freq) == 0
                st.logs = {"batches": st.batches_in_epoch, "lr": self.lr}
                if st.log_now:
                    st.logs["loss"] = dev.all_reduce_mean(window_loss / max(window_calls, 1))
                    window_loss, window_calls = 0.0, 0
                self._fire(Event.STEP_END)
        finally:
            source.close()
        logs: dict[str, Any] = {"loss": dev.all_reduce_mean(epoch_loss / max(epoch_calls, 1)), "lr": self.lr}
        logs.update(self.compute_metrics())
        return logs

    def _consume_result(self, result: Any) -> float | None:
        """Act on what a step returned: a loss tensor is backpropagated and stepped; a dict is logged."""
        if isinstance(result, torch.Tensor):
            self._auto_step(result)
            return float(result.detach().float().item())
        if isinstance(result, dict):
            loss = result.get("loss")
            if isinstance(loss, torch.Tensor):
                return float(loss.detach().float().item())
            return float(loss) if loss is not None else None
        if result is None:
            return None
        raise TypeError(
            f"a training step must return a loss tensor, a dict or None, got {type(result).__name__}"
        )

    # ------------------------------------------------------------------ evaluate / predict
    def _eval_batches(
        self, dataset: Any, batch_size: int, collate_fn: Callable | None
    ) -> tuple[Iterator[Any], int]:
        if batch_size % self.dp_size != 0:
            raise ConfigError(
                f"batch size {batch_size} does not divide over {self.dp_size} data-parallel ranks; "
                f"use a multiple of {self.dp_size}"
            )
        loader = data_lib.eval_loader(
            dataset, batch_size // self.dp_size, self.dp_size, self.dp_rank, collate_fn
        )
        return Prefetcher(iter(loader), self._transfer, depth=self.prefetch), loader.sampler.num_real  # type: ignore[attr-defined]

    @torch.no_grad()
    def evaluate(
        self,
        valid_data: Any,
        batch_size: int = 1,
        steps: int | None = None,
        collate_fn: Callable | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over `valid_data` (every sample counted once, across all ranks)."""
        self.prepare("eval", batch_size)
        was_training = self.module.training
        self.model.eval()
        self.reset_metrics()
        batches, remaining = self._eval_batches(valid_data, batch_size, collate_fn)
        loss_sum, count = 0.0, 0
        try:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                real = min(data_lib.batch_size_of(batch), remaining)
                remaining -= real
                inputs, labels = data_lib.split_batch(batch)
                outputs = self.model(*inputs)
                if real == 0 or labels is None:
                    continue
                outputs, labels = outputs[:real], labels[:real]
                if self.loss is not None:
                    loss_sum += float(self.loss(outputs, labels)) * real
                    count += real
                self._update_metrics(outputs, labels)
        finally:
            batches.close()  # type: ignore[attr-defined]
        totals = dev.all_gather_object((loss_sum, count))
        total_count = sum(c for _, c in totals)
        result = {"loss": sum(s for s, _ in totals) / max(total_count, 1)} if self.loss is not None else {}
        result.update(self.compute_metrics())
        self.reset_metrics()
        self.model.train(was_training)
        return result

    @torch.no_grad()
    def predict(
        self,
        test_data: Any,
        batch_size: int = 1,
        steps: int | None = None,
        collate_fn: Callable | None = None,
    ) -> list[Any]:
        """Model outputs for `test_data`, in dataset order, one entry per global batch (on the CPU)."""
        self.prepare("predict", batch_size)
        was_training = self.module.training
        self.model.eval()
        batches, remaining = self._eval_batches(test_data, batch_size, collate_fn)
        mine: list[torch.Tensor] = []
        try:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                real = min(data_lib.batch_size_of(batch), remaining)
                remaining -= real
                inputs, _ = data_lib.split_batch(batch)
                outputs = self.model(*inputs)
                if real:
                    mine.append(outputs[:real].detach().float().cpu())
        finally:
            batches.close()  # type: ignore[attr-defined]
        self.model.train(was_training)
        shards = [torch.cat(s) if s else None for s in dev.all_gather_object(mine)]
        present = [s for s in shards if s is not None]
        if not present:
            return []
        total = sum(len(s) for s in present)
        out = present[0].new_empty((total, *present[0].shape[1:]))
        for r, shard in enumerate(shards):
            if shard is not None:
                out[r : r + len(shard) * self.dp_size : self.dp_size] = shard
        return list(out.split(batch_size))

    # ------------------------------------------------------------------ helpers
    def cost(self) -> dict[str, int]:
        """Parameter count (placeholder for the fuller cost model)."""
        numel, largest = param_counts(self.module)
        return {"parameters": numel, "largest_parameter": largest}
