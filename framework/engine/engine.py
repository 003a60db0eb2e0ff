"""`Engine`: Paddle-style auto-parallel Engine on top of one DeepSpeed runtime.

    engine = Engine(model, loss, optimizer, metrics, strategy=Strategy(sharding={"stage": 3}))
    history = engine.fit(train_ds, valid_data=valid_ds, epochs=2, batch_size=64)

    # or own the loop
    loader = engine.dataloader(train_ds, batch_size=64, epochs=2, mode="train")
    engine.prepare(mode="train")
    for batch in loader:
        logs = engine.run(batch, mode="train", fetch_list=["features.2", "lr"])

A facade: the runtime (`framework.backend.runtime`) owns DeepSpeed and the batch layout, the loops
(`framework.engine.loops`) train and evaluate, `LoopState` counts, `Metrics` keeps train and eval state.
`batch_size` is always the global batch, split over data-parallel ranks (and accumulation steps
for training).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from framework.backend import estimate as cost_lib
from framework.backend.runtime import Runtime
from framework.data.device_loader import DeviceLoader
from framework.data.outputs import ModelLoss, is_model_loss
from framework.engine import autotune, construct, evaluation, fine_grained, loops, saving
from framework.engine.arguments import check_dataset, check_engine_arguments, check_pipeline
from framework.engine.fine_grained import check_mode
from framework.engine.fit_config import FitConfig, fit_config
from framework.engine.steps import LossFunction, attach_method, method_eval_step, resolve_step
from framework.observe.callbacks import Callback, CallbackList
from framework.observe.metrics import Metrics
from framework.observe.state import LoopState
from framework.plan.strategy import Strategy
from framework.process import watchdog
from framework.process.context import ProcessContext


class Engine:
    """Train, evaluate and predict with a model under a `Strategy`, on DeepSpeed.

    Args:
        model: the `nn.Module` to train (`engine.module`). `engine.model` is what runs it: call
            `engine.model(x)` in a custom step (DeepSpeed's engine once prepared, whose hooks
            gather ZeRO-3 parameters; the plain module before).
        loss: `loss(outputs, labels) -> scalar`, e.g. `nn.CrossEntropyLoss()`; it reads the logits of
            a dict / ModelOutput (`output_key`). `"model"` (or `framework.data.outputs.ModelLoss()`): the
            loss the model computes itself from `labels=`, Hugging Face style.
        optimizer: a torch optimizer, a factory taking parameters (Hydra `_partial_`), or None
            when the strategy's raw `deepspeed` config names one.
        metrics: torchmetrics metric(s), a list or a {name: metric} dict; evaluation uses a copy.
        strategy: a `Strategy`, a dict of its sections, or None for plain data parallel.
        scheduler: a factory `scheduler(optimizer[, total_steps=N])` stepped once per optimizer step.
        train_step: a custom training step; `eval_step`, `predict_step` likewise (see `framework.engine.steps`).
        callbacks: `Callback`s (loggers are callbacks too).
        seed: seed of the data shuffling.
        prefetch: batches kept ready ahead of the step (see `framework.data.loaders.Prefetcher`).
        runtime: a `Runtime` made earlier (to build the model inside its ZeRO-3 context).
        process: the job's `ProcessContext` (`ProcessContext.start(...)`), for several engines in
            one job; without one the engine makes its own when it first needs it, or joins the
            process group that exists, and `close()` ends what it made.
        label_key: the labels' key in dict batches (the model gets the rest as `model(**batch)`).
        output_key: the field of a dict / ModelOutput the loss and metrics read (default: `logits`
            when present, else the first tensor).
        adapter: a `peft` config (`peft.LoraConfig(r=8)`): the model is wrapped with it and only the
            adapter trains (a model wrapped by `peft.get_peft_model` works as it is).
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
        runtime: Runtime | None = None,
        process: ProcessContext | None = None,
        label_key: str = "labels",
        output_key: str | None = None,
        adapter: Any = None,
    ):
        check_engine_arguments(model, loss, optimizer, metrics, scheduler)
        if runtime is None:
            strategy = strategy if isinstance(strategy, Strategy) else Strategy(**(strategy or {}))
            runtime = Runtime(strategy, process)
        self.runtime = runtime
        self.module = model = construct.adapt(model, adapter, runtime.strategy)
        self.label_key, self.output_key = label_key, output_key
        self.loss: Any = ModelLoss() if is_model_loss(loss) else None
        if loss is not None and self.loss is None:
            self.loss = LossFunction(loss, output_key)
        self.optimizer_spec, self.scheduler_spec = optimizer, scheduler
        self.metrics = Metrics(metrics)
        self.train_step_fn = resolve_step(train_step, model, "training_step")
        self.eval_step_fn = resolve_step(eval_step or method_eval_step(train_step), model, "validation_step")
        self.predict_step_fn = resolve_step(predict_step, model, "predict_step")
        check_pipeline(self.strategy, self.loss, self.train_step_fn, self.eval_step_fn)
        self.callbacks = CallbackList(callbacks or [])
        self.seed, self.prefetch = seed, prefetch
        self.state = LoopState()
        self.total_steps: int | None = None  # training's optimizer-step budget (fit / a train dataloader)
        self._scheduled_for: int | None = None  # the budget the lr schedule was built with
        self.mode: str | None = None
        self._prepared: set[str] = set()
        self._padding = fine_grained.PaddingTracker()
        attach_method(self)  # a training method's own setup, before DeepSpeed (DPO's frozen reference)

    # ------------------------------------------------------------------ what the runtime holds
    @property
    def strategy(self) -> Strategy:
        """The strategy as it runs on this machine."""
        return self.runtime.strategy

    @property
    def model(self) -> Any:
        """Call it to run the forward pass (see the class doc)."""
        return self.runtime.forward

    @property
    def process(self) -> Any:
        """The job's `ProcessContext`."""
        return self.runtime.process

    @property
    def deepspeed_config(self) -> Any:
        """The config dict DeepSpeed received."""
        return self.runtime.config

    @property
    def world_size(self) -> Any:
        """Processes in the job."""
        return self.runtime.world_size

    @property
    def dp_size(self) -> Any:
        """Data-parallel degree (replicas of the model)."""
        return self.runtime.dp_size

    @property
    def dp_rank(self) -> Any:
        """This rank's data-parallel index."""
        return self.runtime.dp_rank

    @property
    def lr(self) -> Any:
        """Current learning rate of the first parameter group."""
        return self.runtime.lr

    @property
    def grad_norm(self) -> Any:
        """Gradient norm of the last step."""
        return self.runtime.grad_norm

    @property
    def loss_scale(self) -> Any:
        """Current fp16 loss scale (1.0 without)."""
        return self.runtime.loss_scale

    # ------------------------------------------------------------------ setup
    def prepare(
        self,
        mode: str | None = None,
        batch_size: int | None = None,
        inputs_spec: Any = None,
        labels_spec: Any = None,
    ) -> None:
        """Build DeepSpeed for `mode` (once; again is a no-op). `mode` defaults to the engine's
        current mode ("train" before any). `batch_size` is global; for training it fixes the
        batch layout. `inputs_spec` / `labels_spec` are accepted for Paddle compatibility;
        shapes are taken from the data at run time."""
        fine_grained.prepare(self, self._mode(mode), batch_size)

    def _mode(self, mode: str | None) -> str:
        """`mode`, else the engine's current one ("train" before any), as Paddle's calls default."""
        return check_mode(mode or self.mode or "train")

    def schedule(self, total_steps: int | None) -> None:
        """Give the learning-rate schedule training's optimizer-step budget: `fit` and a training
        `dataloader` call it with their plan's; a schedule built earlier (a `load` before `fit`)
        is rebuilt and continues at its step. Nothing happens without a scheduler."""
        self.total_steps = total_steps if total_steps is not None else self.total_steps
        if self.scheduler_spec is None or self.runtime.optimizer is None:
            return
        if self._scheduled_for != (self.total_steps or 1):
            self._scheduled_for = self.total_steps or 1
            self.runtime.schedule(self.scheduler_spec, self._scheduled_for)

    def transfer(self, batch: Any) -> Any:
        """Move a batch to this rank's device (floating tensors in the compute dtype)."""
        return self.runtime.transfer(batch)

    # ------------------------------------------------------------------ optimisation, for custom steps
    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass for steps that drive optimisation themselves: any number of `backward`
        calls before one `step` accumulate correctly under every ZeRO stage."""
        self.runtime.backward(loss)

    def step(self) -> None:
        """Optimizer step after one or more `backward` calls."""
        self.runtime.step()

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """What the framework does with a loss a step returns: backward, then DeepSpeed's step
        (which applies the update at accumulation boundaries)."""
        self.runtime.backward_and_step(loss)

    def reset_metrics(self) -> None:
        """Clear the accumulated metric state (training and evaluation)."""
        self.metrics.reset()

    # ------------------------------------------------------------------ coarse-grained API
    def fit(
        self,
        train_data: Any,
        valid_data: Any = None,
        *,
        config: FitConfig | None = None,
        callbacks: Iterable[Callback] | None = None,
        **options: Any,
    ) -> dict[str, list[Any]]:
        """Train for `epochs` epochs (or until `max_steps` optimizer steps) and return the history:
        per-epoch lists of loss, lr, each metric and, when validating, val_loss and `val_<metric>`
        (with `valid_at_start`, also start_val_loss, ... measured before the first step).

        The options are keyword arguments named as `framework.engine.fit_config.FitConfig`'s fields, which
        hold their defaults (`fit(ds, epochs=3, batch_size=64)`), or a `config=FitConfig(...)`
        they override; `callbacks` join this call only."""
        cfg = fit_config(config, options)
        check_dataset(train_data, "train_data")
        check_dataset(valid_data, "valid_data", optional=True)
        with watchdog.watching(cfg.timeout_s, self.runtime.process.rank):
            return loops.fit(self, train_data, valid_data, cfg, callbacks or ())

    def evaluate(
        self,
        valid_data: Any,
        batch_size: int = 1,
        steps: int | None = None,
        collate_fn: Callable | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over `valid_data` (every sample counted once, across all ranks)."""
        self.prepare("eval")
        return evaluation.evaluate(self, valid_data, batch_size, steps, collate_fn)

    def predict(
        self,
        test_data: Any,
        batch_size: int = 1,
        steps: int | None = None,
        collate_fn: Callable | None = None,
    ) -> list[Any]:
        """Model outputs for `test_data`, in dataset order, one CPU tensor per global batch."""
        self.prepare("predict")
        return evaluation.predict(self, test_data, batch_size, steps, collate_fn)

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
        mode: str | None = None,
    ) -> DeviceLoader:
        """This rank's share of `dataset` in global batches of `batch_size`, on the device, for
        `epochs` epochs; prepares `mode` (default: the engine's current mode, "train" before any)
        if it is not prepared yet. Each epoch starts this mode's metrics afresh.

        Train batches hold batch_size / data-parallel ranks samples (`run` splits them into the
        accumulation steps); every train batch is full, whatever `drop_last` says (DeepSpeed
        steps a fixed micro-batch). Eval/predict shards cover each sample once, also the last
        incomplete batch (`run` ignores the padding that evens them out)."""
        mode = self._mode(mode)
        loader = fine_grained.dataloader(
            self, dataset, batch_size, mode, shuffle, collate_fn, num_workers, epochs, steps_per_epoch
        )
        return self._padding.track(loader) if mode != "train" else loader

    def dataloader_from_generator(
        self,
        generator: Any,
        batch_size: int = 1,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        collate_fn: Callable | None = None,
        mode: str | None = None,
    ) -> DeviceLoader:
        """Legacy path for a Python generator of samples (a callable returning an iterator, or a
        re-iterable): samples are dealt round-robin to ranks and collated into global batches."""
        return fine_grained.generator_loader(
            self, generator, batch_size, self._mode(mode), epochs, steps_per_epoch, collate_fn
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
        `{"loss", <training metrics so far>, "fetches"}`; eval: `{"loss", <evaluation metrics
        so far>, "fetches"}`; predict: `{"outputs", "fetches"}`. `feed` is an alternative to `data`:
        {"inputs": ..., "labels": ...}. `fetch_list` names sub-modules whose outputs to return,
        plus "lr", "grad_norm" and "loss_scale". Metrics accumulate over an epoch of an engine's
        loader, or until `reset_metrics()`."""
        return fine_grained.run(
            self, data, feed, fetch_list, mode or self.mode, self._prepared, self._padding
        )

    def close(self) -> None:
        """End the process context and group this engine made (nothing for one it was given); a
        script gets the same at exit. Also `with Engine(...) as engine:`."""
        self.runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runtime.close(sync=exc[0] is None)

    # ------------------------------------------------------------------ weights and checkpoints
    def save(self, path: str, training: bool = True) -> str:
        """training=True: a full checkpoint (weights, optimizer, loop state) under the checkpoints
        dir `path`, atomic, resumable with `load` or `fit(resume=...)`; training=False: the
        consolidated fp32 weights in one file for inference (`.safetensors` or a torch state
        dict), written by rank 0. Collective: call it on every rank. Returns what was written."""
        return saving.save(self, path, training)

    def load(self, path: str) -> None:
        """Load what `save` wrote: a checkpoint (dir) restores weights, optimizer and loop state;
        a weights file restores the weights (and a training method's frozen reference follows)."""
        trains = self.optimizer_spec is not None and (self.loss is not None or self.train_step_fn is not None)
        saving.load(self, path, trains)

    def autotune(
        self, train_data: Any, batch_size: int, memory_gb: float | None = None, **options: Any
    ) -> tuple[Strategy, list[dict[str, Any]]]:
        """Try the layouts of `batch_size` that may fit `memory_gb` per rank (default: the device's) a few
        steps each; train with the fastest that fits from now on. Returns it and the trials (`autotune.search`)."""
        strategy, table = autotune.search(self, train_data, batch_size, memory_gb, **options)
        self.runtime = Runtime(strategy, self.process)
        return strategy, table

    def cost(self, mode: str = "train", world_size: int | None = None) -> dict[str, Any]:
        """Estimated per-rank bytes of parameters, gradients and optimizer states under this
        strategy (see `framework.plan.cost`), before anything runs; DeepSpeed's own estimate beside it."""
        check_mode(mode)
        optimizer = self.optimizer_spec if mode == "train" else None
        return cost_lib.estimate(self.module, self.strategy, optimizer, world_size or self.world_size, mode)
