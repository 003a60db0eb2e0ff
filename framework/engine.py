"""`Engine`: Paddle-style auto-parallel Engine on top of one DeepSpeed engine.

    engine = Engine(model, loss, optimizer, metrics, strategy=Strategy(sharding={"stage": 3}))
    history = engine.fit(train_ds, valid_data=valid_ds, epochs=2, batch_size=64)

    # or own the loop
    loader = engine.dataloader(train_ds, batch_size=64, epochs=2, mode="train")
    engine.prepare(mode="train")
    for batch in loader:
        logs = engine.run(batch, mode="train", fetch_list=["features.2", "lr"])

`batch_size` is always the global batch, split over data-parallel ranks (and accumulation
steps for training). One DeepSpeed engine holds the weights for every mode.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from framework import cost as cost_lib
from framework import data as data_lib
from framework import device as dev
from framework import loops
from framework import pipeline as pipeline_lib
from framework import recompute as recompute_lib
from framework.callbacks import Callback, Event, TrainState
from framework.steps import bind_step, resolve_step
from framework.strategy import (
    BatchLayout,
    ConfigError,
    Strategy,
    batch_layout,
    compute_dtype_name,
    deepspeed_config,
)

MODES = ("train", "eval", "predict")
SPECIAL_FETCHES = ("lr", "grad_norm", "loss_scale")


def check_mode(mode: str) -> str:
    """`mode` if it is one of train / eval / predict, else a ValueError listing them."""
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


def strategy_for_this_machine(strategy: Strategy) -> Strategy:
    """`strategy` as it will run here: without an accelerator, offload is dropped (see
    `Strategy.for_host_only`) and rank 0 says so in one line."""
    if dev.cuda_available():
        return strategy
    host = strategy.for_host_only()
    if host is not strategy and dev.is_main_process():
        print(
            "strategy: no accelerator, so offload has nowhere to move states to; "
            f"running {host.describe()} (states stay in host memory)",
            flush=True,
        )
    return host


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


def split_micro_batches(batch: Any, parts: int) -> list[Any]:
    """Split every tensor of a batch along dim 0 into `parts` equal micro-batches."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % parts:
            raise ConfigError(f"a batch of {batch.shape[0]} does not split into {parts} accumulation steps")
        return list(batch.chunk(parts))
    if isinstance(batch, (list, tuple)):
        columns = [split_micro_batches(b, parts) for b in batch]
        return [type(batch)(col[i] for col in columns) for i in range(parts)]
    if isinstance(batch, dict):
        split = {k: split_micro_batches(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(parts)]
    return [batch] * parts


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
        train_step / eval_step / predict_step: custom steps (see `framework.steps`); default:
            loss(model(x), y), and model(x) for predict. A predict step returns the outputs of the
            batch(es) it pulled, their samples first to last.
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
        predict_step: Callable[..., Any] | None = None,
        callbacks: Iterable[Callback] | None = None,
        seed: int = 0,
        prefetch: int = 2,
    ):
        self.module = model
        self.model: Any = model  # the DeepSpeed engine once prepared: engine.model(x) runs the forward pass
        self.loss = _Loss(loss) if loss is not None else None
        self.optimizer_spec = optimizer
        self.scheduler_spec = scheduler
        self.metrics = _named_metrics(metrics)
        self.strategy = strategy_for_this_machine(
            strategy if isinstance(strategy, Strategy) else Strategy(**(strategy or {}))
        )
        self.train_step_fn = resolve_step(train_step, model, "training_step")
        self.eval_step_fn = resolve_step(eval_step, model, "validation_step")
        self.predict_step_fn = resolve_step(predict_step, model, "predict_step")
        if self.strategy.uses_pipeline and (self.train_step_fn is not None or self.eval_step_fn is not None):
            raise ConfigError(
                "custom training/validation steps cannot run with pipeline parallelism: "
                "the pipeline engine drives the micro-batches itself"
            )
        self.callbacks: list[Callback] = list(callbacks or [])
        self.seed = seed
        self.prefetch = prefetch
        self.ds_engine: Any = None
        self.deepspeed_config: dict[str, Any] | None = None
        self.layout: BatchLayout | None = None
        self.state = TrainState(engine=self)
        self.total_steps: int | None = None  # for schedulers that want it; set by fit()
        self.mode: str | None = None
        self._prepared: set[str] = set()
        self._float_dtype = getattr(torch, compute_dtype_name(self.strategy))
        self._last_grad_norm: torch.Tensor | None = None
        # ZeRO-0 gets no norm from DeepSpeed: computed before its step frees the gradients, only
        # when someone asks (run(fetch_list=["grad_norm"])): it costs ~5% of a small model's step.
        self.grad_norm_wanted = False
        self._eval_loaders: list[weakref.ref[data_lib.DeviceLoader]] = []
        self.load_universal = False  # resuming a checkpoint written with another world size
        self.handle_preemption = False  # SIGTERM -> checkpoint at the next step boundary (set by the CLI)
        self.resumed_from: str | None = None

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
        """Build the DeepSpeed engine for `mode` (once; again is a no-op). `batch_size` is global.

        `inputs_spec` / `labels_spec` are accepted for Paddle compatibility; shapes are taken
        from the data at run time."""
        check_mode(mode)
        has_optimizer = self.optimizer_spec is not None or "optimizer" in self.strategy.deepspeed
        if mode == "train" and (self.loss is None and self.train_step_fn is None or not has_optimizer):
            raise ConfigError("set optimizer and loss before training (Engine(model, loss, optimizer, ...))")
        if mode == "eval" and self.loss is None and self.eval_step_fn is None:
            raise ConfigError("set loss before evaluation (Engine(model, loss, ...))")
        self.mode = mode
        if mode in self._prepared:
            return
        dev.init_process_group()
        if self.ds_engine is None:
            self._build(
                batch_size or self.dp_size * self.strategy.accumulation_steps, with_optimizer=has_optimizer
            )
        self._prepared.add(mode)

    def _build(self, global_batch_size: int, with_optimizer: bool) -> None:
        import deepspeed

        dev.quiet_deepspeed()
        self.layout = batch_layout(self.strategy, global_batch_size, self.world_size)
        numel, largest = param_counts(self.module)
        self.deepspeed_config = deepspeed_config(
            self.strategy,
            global_batch_size,
            self.world_size,
            numel,
            largest,
            load_universal=self.load_universal,
        )
        self.module.to(dev.device())
        if self.strategy.recompute.enable and not self.strategy.uses_pipeline:
            recompute_lib.enable(self.module)
        if self.strategy.compile:
            self.module.compile()
        module = self.module
        if self.strategy.uses_pipeline:
            if self.loss is None:
                raise ConfigError("pipeline parallelism needs a loss: the last stage computes it")
            module = pipeline_lib.build_pipeline_module(self.module, self.strategy, self.loss)
        optimizer = self.optimizer_spec if with_optimizer else None
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.ds_engine, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            model_parameters=trainable if optimizer is None or callable(optimizer) else None,
            lr_scheduler=self._scheduler_factory() if with_optimizer else None,
            config=self.deepspeed_config,
        )
        self.model = self.ds_engine
        if self.dp_size == 1 and self.strategy.sharding.stage == 0 and not self.strategy.uses_pipeline:
            # One data-parallel rank: DeepSpeed would still flatten and "all-reduce" every gradient
            # over a group of one each step (pure copies).
            self.ds_engine.enable_backward_allreduce = self.strategy.amp.enable
        if self._float_dtype != torch.float32:
            # engine.model(x) with float32 inputs (a user's own tensors) computes in the model's dtype.
            self.module.register_forward_pre_hook(lambda _m, args: self.transfer(args))
        for metric in self.metrics.values():
            metric.to(dev.device())
        if self.loss is not None and isinstance(self.loss.fn, nn.Module):
            self.loss.fn.to(dev.device())

    def _scheduler_factory(self) -> Callable[[Any], Any] | None:
        spec = self.scheduler_spec
        if spec is None:
            return None
        try:
            wants_total = "total_steps" in inspect.signature(spec).parameters
        except (TypeError, ValueError):
            wants_total = False
        if wants_total:
            return lambda opt: spec(opt, total_steps=self.total_steps or 1)
        return spec

    def transfer(self, batch: Any) -> Any:
        """Move a batch to this rank's device (floating tensors in the compute dtype)."""
        return dev.to_device(
            batch, dev.device(), self._float_dtype if self._float_dtype != torch.float32 else None
        )

    def fire(self, event: Event) -> None:
        """Run every callback's handler for `event`."""
        for callback in self.callbacks:
            callback.on_event(event, self.state)

    # ------------------------------------------------------------------ optimisation
    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass through DeepSpeed, for steps that drive optimisation themselves.

        Several `backward` calls before one `step` accumulate correctly under every ZeRO stage:
        each is a non-boundary micro-step (the loss is used as given, not divided by the
        accumulation steps); `step` closes the accumulation and applies it."""
        self.ds_engine.set_gradient_accumulation_boundary(False)
        self.ds_engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        """Optimizer step after one or more `backward` calls.

        Closing an accumulation that ran entirely off-boundary differs by stage (measured
        against plain torch, DeepSpeed 0.19): ZeRO-0/1 reduce the accumulated `.grad`s
        explicitly; ZeRO-2 reduces only inside a boundary backward, so a zero-valued backward
        over the parameters marks it; ZeRO-3 needs nothing more."""
        ds = self.ds_engine
        ds.set_gradient_accumulation_boundary(True)
        stage = ds.zero_optimization_stage()
        if stage < 2:
            ds.allreduce_gradients()
        elif stage == 2:
            zero = sum((p * 0).sum() for p in self.module.parameters() if p.requires_grad)
            ds.backward(zero, scale_wrt_gas=False)
        self._note_grad_norm()
        ds.step()

    def at_step_boundary(self) -> bool:
        """True between optimizer steps (no gradient accumulation half done): a safe point to checkpoint."""
        ds = self.ds_engine
        if ds is None or self.strategy.uses_pipeline:
            return True
        return ds.micro_steps % ds.gradient_accumulation_steps() == 0

    def auto_step(self, loss: torch.Tensor) -> None:
        """Backward + step of one micro-batch; DeepSpeed applies the update at accumulation boundaries."""
        self.ds_engine.backward(loss)
        if self.ds_engine.is_gradient_accumulation_boundary():
            self._note_grad_norm()
        self.ds_engine.step()

    def _note_grad_norm(self) -> None:
        if not self.grad_norm_wanted or self.ds_engine.zero_optimization_stage() != 0:
            return
        grads = [p.grad.detach().float() for p in self.module.parameters() if p.grad is not None]
        # stays a tensor: no device sync until the value is read
        self._last_grad_norm = torch.stack(torch._foreach_norm(grads)).norm() if grads else None

    @property
    def lr(self) -> float:
        """Current learning rate of the first parameter group."""
        opt = self.ds_engine.optimizer if self.ds_engine is not None else None
        groups = getattr(opt, "param_groups", None) or []
        return float(groups[0]["lr"]) if groups else 0.0

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm of the last optimizer step (ZeRO-0: of the last step that had
        `grad_norm_wanted` set, as `run(fetch_list=["grad_norm"])` does; DeepSpeed reports it
        for the other stages)."""
        norm = self.ds_engine.get_global_grad_norm() if self.ds_engine is not None else None
        if norm is None:
            norm = self._last_grad_norm
        if norm is None:
            return None
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    @property
    def loss_scale(self) -> float:
        """Current fp16 loss scale (1.0 without fp16)."""
        opt = self.ds_engine.optimizer if self.ds_engine is not None else None
        return float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 1.0)) or 1.0)

    # ------------------------------------------------------------------ metrics
    def reset_metrics(self) -> None:
        """Clear accumulated metric state."""
        for metric in self.metrics.values():
            metric.reset()

    def update_metrics(self, outputs: Any, labels: Any) -> None:
        """Accumulate a batch into every metric."""
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

    # ------------------------------------------------------------------ default steps
    def default_train_step(self, batch: Any) -> torch.Tensor:
        """loss(model(*inputs), labels), updating the training metrics."""
        inputs, labels = data_lib.split_batch(batch)
        outputs = self.model(*inputs)
        assert self.loss is not None
        loss = self.loss(outputs, labels)
        self.update_metrics(outputs, labels)
        return loss

    def eval_batch(self, batch: Any, real: int) -> tuple[Any, float | None]:
        """Forward one evaluation batch; loss and metrics over its first `real` samples."""
        inputs, labels = data_lib.split_batch(batch)
        outputs = self.model(*inputs)
        if real == 0 or labels is None or self.loss is None:
            return outputs, None
        outputs, labels = outputs[:real], labels[:real]
        self.update_metrics(outputs, labels)
        return outputs, float(self.loss(outputs, labels))

    # ------------------------------------------------------------------ coarse-grained API
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
        valid_at_start: bool = False,
        save_dir: str | None = None,
        save_freq: int = 0,
        keep_last_k: int | None = 3,
        resume: str | None = None,
    ) -> dict[str, list[Any]]:
        """Train for `epochs` epochs (or until `max_steps` optimizer steps) and return the history:
        per-epoch lists of loss, lr, each metric and, when validating, val_loss and val_<metric>
        (with `valid_at_start`, also start_val_loss, ... measured before the first step).

        `steps_per_epoch` caps optimizer steps per epoch; `log_freq` is in optimizer steps.
        With `save_dir`, a checkpoint every `save_freq` optimizer steps (0: only at the end),
        the newest `keep_last_k` kept; `resume` ("auto" or a checkpoint path) continues one."""
        self.callbacks.extend(callbacks or [])
        return loops.fit(
            self, train_data, valid_data, epochs, batch_size, steps_per_epoch, valid_freq, log_freq,
            max_steps, valid_batch_size, shuffle, collate_fn, num_workers, valid_at_start,
            save_dir, save_freq, keep_last_k, resume,
        )  # fmt: skip

    def evaluate(
        self,
        valid_data: Any,
        batch_size: int = 1,
        steps: int | None = None,
        collate_fn: Callable | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over `valid_data` (every sample counted once, across all ranks)."""
        self.prepare("eval", batch_size)
        return loops.evaluate(self, valid_data, batch_size, steps, collate_fn)

    def predict(
        self,
        test_data: Any,
        batch_size: int = 1,
        steps: int | None = None,
        collate_fn: Callable | None = None,
    ) -> list[Any]:
        """Model outputs for `test_data`, in dataset order, one CPU tensor per global batch."""
        self.prepare("predict", batch_size)
        return loops.predict(self, test_data, batch_size, steps, collate_fn)

    # ------------------------------------------------------------------ fine-grained API
    def dataloader(
        self,
        dataset: Any,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        mode: str = "train",
    ) -> data_lib.DeviceLoader:
        """This rank's share of `dataset` in global batches of `batch_size`, on the device, for
        `epochs` epochs; prepares `mode` if it is not prepared yet.

        Train batches hold batch_size / data-parallel ranks samples (`run` splits them into the
        accumulation steps); every train batch is full, whatever `drop_last` says (DeepSpeed
        steps a fixed micro-batch, so an incomplete last batch is always left out). Eval/predict
        shards cover each sample once, also the last incomplete batch (`run` ignores the padding
        that evens them out). `drop_last` is kept for the signature Paddle users know."""
        check_mode(mode)
        dev.init_process_group()
        if mode == "train":
            layout = batch_layout(self.strategy, batch_size, self.world_size)
            per_rank = layout.micro_batch_size * layout.accumulation_steps
            loader = data_lib.train_loader(
                dataset,
                per_rank,
                self.dp_size,
                self.dp_rank,
                shuffle,
                self.seed,
                True,
                collate_fn,
                num_workers,
            )
            if self.total_steps is None:
                self.total_steps = epochs * (steps_per_epoch or len(loader))
            self.prepare(mode, batch_size)
            return data_lib.DeviceLoader(
                loader, self.transfer, epochs, steps_per_epoch, self.prefetch, batch_size
            )
        if batch_size % self.dp_size:
            raise ConfigError(
                f"batch size {batch_size} does not divide over {self.dp_size} data-parallel ranks; use a multiple of {self.dp_size}"
            )
        self.prepare(mode, batch_size)
        loader = data_lib.eval_loader(
            dataset, batch_size // self.dp_size, self.dp_size, self.dp_rank, collate_fn, num_workers
        )
        real = loader.sampler.num_real  # type: ignore[attr-defined]
        device_loader = data_lib.DeviceLoader(
            loader, self.transfer, epochs, steps_per_epoch, self.prefetch, batch_size, real
        )
        self._eval_loaders = [r for r in self._eval_loaders if r() is not None] + [weakref.ref(device_loader)]
        return device_loader

    def dataloader_from_generator(
        self,
        generator: Any,
        batch_size: int = 1,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        collate_fn: Callable | None = None,
        mode: str = "train",
    ) -> data_lib.DeviceLoader:
        """Legacy path for a Python generator of samples (a callable returning an iterator, or a
        re-iterable): samples are dealt round-robin to ranks and collated into global batches."""
        check_mode(mode)
        dev.init_process_group()
        layout = batch_layout(self.strategy, batch_size, self.world_size) if mode == "train" else None
        if layout is None and batch_size % self.dp_size:
            raise ConfigError(
                f"batch size {batch_size} does not divide over {self.dp_size} data-parallel ranks"
            )
        per_rank = batch_size // self.dp_size
        source = data_lib.GeneratorDataset(generator, self.dp_size, self.dp_rank)
        loader = torch.utils.data.DataLoader(
            source, batch_size=per_rank, drop_last=True, collate_fn=collate_fn
        )
        self.prepare(mode, batch_size)
        return data_lib.DeviceLoader(
            loader, self.transfer, epochs, steps_per_epoch, self.prefetch, batch_size
        )

    def run(
        self,
        data: Any = None,
        feed: dict[str, Any] | None = None,
        fetch_list: list[str] | None = None,
        mode: str | None = None,
    ) -> dict[str, Any]:
        """Run exactly one step of `mode` on one batch and return its logs.

        train: one optimizer step (the batch is split into the accumulation steps) ->
        {"loss", <metrics so far>, "fetches"}; eval: {"loss", <metrics so far>, "fetches"};
        predict: {"outputs", "fetches"}. `feed` is an alternative to `data`:
        {"inputs": ..., "labels": ...}. `fetch_list` names sub-modules whose outputs to return,
        plus "lr", "grad_norm" and "loss_scale". Metrics accumulate until `reset_metrics()`."""
        mode = mode or self.mode
        if mode is None or (mode in MODES and mode not in self._prepared):
            raise ConfigError(
                f"nothing is prepared for mode {mode or 'train'!r}: call engine.prepare(mode=...) "
                "or engine.dataloader(..., mode=...) first"
            )
        check_mode(mode)
        if data is None and feed is not None:
            data = (feed["inputs"], feed["labels"]) if "labels" in feed else feed["inputs"]
        if data is None:
            raise ValueError("run() needs a batch: run(batch) or run(feed={'inputs': x, 'labels': y})")
        batch = self.transfer(data)
        self.grad_norm_wanted = "grad_norm" in (fetch_list or ())
        try:
            with self._capture(fetch_list) as captured:
                logs = self._run_one(batch, mode, real=self._real_count(data))
        finally:
            self.grad_norm_wanted = False
        logs["fetches"] = self._fetches(fetch_list, captured)
        return logs

    def _run_one(self, batch: Any, mode: str, real: int) -> dict[str, Any]:
        if mode == "train":
            self.model.train()
            assert self.layout is not None
            losses = []
            call = bind_step(self.train_step_fn) if self.train_step_fn is not None else None
            for micro in split_micro_batches(batch, self.layout.accumulation_steps):
                result: Any = self.default_train_step(micro) if call is None else call(self, iter([micro]))
                value = loops.consume_result(self, result)
                if value is not None:
                    losses.append(value)
            return {"loss": sum(losses) / len(losses) if losses else None, **self.compute_metrics()}
        with torch.no_grad():
            was_training = self.module.training
            self.model.eval()
            if mode == "eval":
                _, loss = self.eval_batch(batch, real)
                logs: dict[str, Any] = {"loss": loss, **self.compute_metrics()}
            elif self.predict_step_fn is not None:  # the same step predict() uses
                outputs = bind_step(self.predict_step_fn)(self, iter([batch]))
                logs = {"outputs": outputs[:real]}
            else:
                inputs, _ = data_lib.split_batch(batch)
                logs = {"outputs": self.model(*inputs)[:real]}
            self.model.train(was_training)
        return logs

    def _real_count(self, data: Any) -> int:
        """Samples of `data` that are real: all, unless it is the batch an eval shard just padded."""
        for ref in self._eval_loaders:
            loader = ref()
            if loader is not None and loader.last_batch is data and loader.last_real is not None:
                return loader.last_real
        return data_lib.batch_size_of(data)

    @contextlib.contextmanager
    def _capture(self, names: list[str] | None) -> Iterator[dict[str, list[Any]]]:
        captured: dict[str, list[Any]] = {}
        modules = dict(self.module.named_modules())
        handles = []
        for name in names or []:
            if name in SPECIAL_FETCHES:
                continue
            if name not in modules:
                close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
                hint = f"; closest: {', '.join(close)}" if close else ""
                raise ValueError(
                    f"fetch_list name {name!r} is not a sub-module of {type(self.module).__name__}{hint}"
                )

            def hook(_module: nn.Module, _inputs: Any, output: Any, _name: str = name) -> None:
                captured.setdefault(_name, []).append(
                    output.detach() if isinstance(output, torch.Tensor) else output
                )

            handles.append(modules[name].register_forward_hook(hook))
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def _fetches(self, names: list[str] | None, captured: dict[str, list[Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in names or []:
            if name == "lr":
                out[name] = self.lr
            elif name == "grad_norm":
                out[name] = self.grad_norm
            elif name == "loss_scale":
                out[name] = self.loss_scale
            else:
                values = captured.get(name, [])
                tensors = all(isinstance(v, torch.Tensor) for v in values)
                out[name] = (
                    torch.cat(values)
                    if values and tensors and len(values) > 1
                    else (values[0] if values else None)
                )
        return out

    def save(self, path: str, training: bool = True) -> str:
        """training=True: a full checkpoint (weights, optimizer, loop state) under the checkpoints
        dir `path`, atomic, resumable with `load` or `fit(resume=...)`; training=False: the
        consolidated fp32 weights in one file for inference (`.safetensors` or a torch state
        dict), written by rank 0. Collective: call it on every rank. Returns what was written."""
        from framework import checkpoint, export

        if self.ds_engine is None:
            raise ConfigError("nothing to save yet: prepare(mode=...) or fit() first")
        if training:
            return str(checkpoint.save(self, path))
        state = {
            k: v.float() if v.is_floating_point() else v for k, v in checkpoint.full_state_dict(self).items()
        }
        if dev.is_main_process():
            export.save_weights(state, path)
        return path

    def load(self, path: str) -> None:
        """Load what `save` wrote: a checkpoint (dir) restores weights, optimizer and loop state;
        a weights file restores the weights."""
        from pathlib import Path

        from framework import checkpoint, export

        if self.ds_engine is None:
            self.prepare("train" if self.optimizer_spec is not None and self.loss is not None else "predict")
        if Path(path).is_dir():
            found = checkpoint.resolve(path, None)
            if found is None:
                raise ConfigError(f"no complete checkpoint in {path}")
            checkpoint.load(self, found)
            self.resumed_from = str(found)
        else:
            checkpoint.load_full_state_dict(self, export.load_weights(path))

    def cost(self, mode: str = "train", world_size: int | None = None) -> dict[str, Any]:
        """Estimated per-rank bytes of parameters, gradients and optimizer states under this
        strategy (see `framework.cost`), before anything runs; DeepSpeed's own estimate beside it."""
        check_mode(mode)
        numel, largest = param_counts(self.module)
        ws = world_size or self.world_size
        k = (
            cost_lib.optimizer_state_bytes_per_param(self.optimizer_spec)
            if self.optimizer_spec is not None
            else 8
        )
        if mode != "train":
            k = 0
        estimate: dict[str, Any] = cost_lib.model_state_bytes(self.strategy, numel, largest, ws, k)
        if mode != "train":
            estimate["grads_bytes"] = 0
            estimate["total_bytes"] = estimate["params_bytes"] + estimate["optimizer_bytes"]
        estimate["largest_parameter"] = largest
        estimate["deepspeed_estimate"] = cost_lib.deepspeed_estimate(self.strategy, numel, largest, ws)
        return estimate
