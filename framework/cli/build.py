"""A composed config becomes objects: the one place (strategy, runtime, data, model, engine, fit config).

`train(cfg, output_dir)` is one rank's run, a straight line::

    process group -> Runtime(strategy) with the batch layout fixed -> data -> model (inside the
    runtime's ZeRO-3 context) -> loss, metrics, optimizer, scheduler, loggers -> Engine.fit -> files
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from framework import checkpoint
from framework.backend.runtime import Runtime
from framework.checkpoint import preemption
from framework.cli import construct
from framework.cli.config import RENAMED, check_schema
from framework.cli.report import RunFiles, print_plan
from framework.data.datasets import as_splits
from framework.engine import preference
from framework.engine.construct import check_adapted
from framework.engine.engine import Engine
from framework.engine.fit_config import FitConfig
from framework.errors import CheckpointError, ConfigError
from framework.integrations import hf
from framework.observe import runlog
from framework.observe.callbacks import Callback
from framework.observe.loggers import MetricsFile
from framework.plan.run_plan import batch_layout, mesh_of
from framework.plan.strategy import Strategy
from framework.process import slurm
from framework.process.context import ProcessContext, launched
from framework.process.launch import check_launched_devices


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_strategy(cfg: DictConfig) -> Strategy:
    """The run's `Strategy` from the composed `strategy` node (validated)."""
    return Strategy.from_config(OmegaConf.to_container(cfg.strategy, resolve=True))


def validate(cfg: DictConfig, world_size: int) -> Strategy:
    """Checks that need no process group: schema, strategy, batch split over `world_size`."""
    check_schema(cfg)
    strategy = build_strategy(cfg)
    mesh_of(strategy, world_size)  # degrees that do not divide the processes: the strategy's error
    _with_key("trainer.batch_size", batch_layout, strategy, int(cfg.trainer.batch_size), world_size)
    if cfg.get("adapter") is not None:
        check_adapted(strategy)  # a parallelism adapters do not support: before any process starts
    return strategy


def _with_key(key: str, fn: Any, *args: Any) -> Any:
    """Call `fn`; a ConfigError names the config key it is about."""
    try:
        return fn(*args)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def logged_names(cfg: DictConfig, has_valid: bool) -> list[str]:
    """Every value a run of `cfg` logs (its history): loss, lr and each metric, their `val_`
    versions when there is validation data (also as `start_val_*` with `trainer.valid_at_start`),
    and what the framework's callbacks add (`best_<monitor>`, `lr_step`)."""
    train = ["loss", "lr", *(str(name) for name in cfg.metrics)]
    valid = ["val_loss", *(f"val_{name}" for name in cfg.metrics)] if has_valid else []
    start = [f"start_{name}" for name in valid] if cfg.trainer.valid_at_start else []
    added = []
    for node in (n for n in cfg.callbacks.values() if n is not None):
        target = str(node.get("_target_", ""))
        if target.endswith("KeepBest") and node.get("monitor"):
            added.append(f"best_{node.monitor}")
        if target.endswith("LearningRateMonitor"):
            added.append("lr_step")
    return train + valid + start + added


def check_monitors(cfg: DictConfig, has_valid: bool) -> None:
    """`trainer.monitor` and each callback's `monitor` name a value the run logs (a typo would
    watch nothing: the run would return None and EarlyStopping/KeepBest never act). A callback of
    the user's own may log more values: `trainer.monitor` is then not checked."""
    names = logged_names(cfg, has_valid)
    callbacks = {str(key): node for key, node in cfg.callbacks.items() if node is not None}
    own = all(str(node.get("_target_", "")).startswith("framework.") for node in callbacks.values())
    keys = [("trainer.monitor", cfg.trainer.monitor)] if own else []
    keys += [(f"callbacks.{key}.monitor", node.get("monitor")) for key, node in callbacks.items()]
    for key, value in keys:
        if value is not None and str(value) not in names:
            hint = "" if has_valid else " (this run has no validation data, so no val_* values)"
            raise ConfigError(
                f"{key}={value}: this run logs no such value{hint}; choose one of {', '.join(names)}"
            )


def build_fit_config(
    cfg: DictConfig, ckpt_dir: Path, handle_preemption: bool, resume: str | None, main: bool = True
) -> FitConfig:
    """`Engine.fit`'s arguments from `trainer.*` and `data.*` (`resume`: see `resume_choice`;
    `main`: this is rank 0, which says what is deprecated)."""
    t = cfg.trainer
    return FitConfig(
        epochs=t.epochs,
        batch_size=t.batch_size,
        steps_per_epoch=t.steps_per_epoch,
        valid_freq=renamed(cfg, "trainer.valid_every", main),
        log_freq=renamed(cfg, "trainer.log_every", main),
        max_steps=t.max_steps,
        valid_batch_size=t.valid_batch_size,
        valid_steps=t.valid_steps,
        shuffle=cfg.data.shuffle,
        shuffle_window=cfg.data.shuffle_window,
        collate_fn=_optional(cfg.data.collate_fn),
        num_workers=cfg.data.num_workers,
        valid_at_start=t.valid_at_start,
        save_dir=str(ckpt_dir) if t.checkpoint.enabled else None,
        save_freq=renamed(cfg, "trainer.checkpoint.every_n_steps", main),
        keep_last_k=t.checkpoint.keep_last_k,
        resume=resume,
        handle_preemption=handle_preemption,
        preemption_grace_s=t.checkpoint.grace_s,
        peak_tflops=t.peak_tflops,
        timeout_s=float(t.timeout_s),  # a stuck rank ends the job within timeout_s
        progress=False,  # the logger group decides what the console shows
    )


def resume_choice(cfg: DictConfig, main: bool = True) -> str | None:
    """`trainer.resume`; unset in a requeued Slurm job (the time limit or a preemption stopped its
    earlier attempt, which saved), `auto`: the attempt goes on from the newest checkpoint (rank 0,
    `main`, says so)."""
    if cfg.trainer.resume is None and cfg.trainer.checkpoint.enabled and slurm.requeued():
        if main:
            print(
                f"slurm: requeued (attempt {int(os.environ['SLURM_RESTART_COUNT']) + 1}): trainer.resume=auto"
            )
        return "auto"
    return None if cfg.trainer.resume is None else str(cfg.trainer.resume)


def renamed(cfg: DictConfig, old: str, main: bool = True) -> Any:
    """The value of the key `old` was renamed to; `old` itself wins when set, with a one-line
    deprecation from rank 0 (`main`; see `framework.cli.config.RENAMED`)."""
    value = OmegaConf.select(cfg, old)
    if value is None:
        return OmegaConf.select(cfg, RENAMED[old])
    if main:
        print(f"{old} is deprecated: use {RENAMED[old]} (same meaning)", flush=True)
    return value


def checkpoint_dir(cfg: DictConfig, output_dir: str | Path) -> Path:
    """Where this run's checkpoints go: `trainer.checkpoint.dir`, else `<output dir>/checkpoints`."""
    return (
        Path(cfg.trainer.checkpoint.dir) if cfg.trainer.checkpoint.dir else Path(output_dir) / "checkpoints"
    )


def instantiate_with_context(node: DictConfig, context: dict[str, Any]) -> Any:
    """Instantiate a logger or callback, giving it whichever of this run's `context` entries
    (output_dir, run_config, group, name) its signature asks for and its config leaves unset."""
    from hydra.utils import get_method

    try:
        params = inspect.signature(get_method(node._target_)).parameters
    except Exception:
        params = {}  # type: ignore[assignment]
    extra = {k: v for k, v in context.items() if k in params and node.get(k) is None and v is not None}
    # Passed at call time: Hydra would otherwise try to instantiate the _target_s inside run_config.
    return instantiate(node, _partial_=True)(**extra)


def _instantiate(node: Any, key: str) -> Any:
    """`instantiate(node)`; a value of the wrong type for the target's parameter (what torch would
    report from deep inside, e.g. `empty() received an invalid combination`) names the key."""
    try:
        return instantiate(node)
    except InstantiationException:
        mismatch = _type_mismatch(node, key)
        if mismatch:
            raise ConfigError(mismatch) from None
        raise


def _type_mismatch(node: Any, key: str) -> str | None:
    """'model.in_features=abc: MLP takes an integer for in_features', or None."""
    import typing

    from hydra.utils import get_object

    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    try:
        target: Any = get_object(node._target_)
        hints = typing.get_type_hints(getattr(target, "__init__") if isinstance(target, type) else target)  # noqa: B009
    except Exception:  # noqa: BLE001 - no usable annotations: nothing to say
        return None
    words = {int: "an integer", float: "a number", bool: "true or false"}
    for item, value in node.items():
        name = str(item)
        expected = hints.get(name)
        if expected in words and isinstance(value, str):
            return f"{key}.{name}={value}: {getattr(target, '__name__', target)} takes {words[expected]} for {name}"
    return None


def _build_model(node: Any, runtime: Runtime, adapter: Any = None) -> Any:
    """The model, built as `strategy.sharding.init` says under ZeRO-3 and adapted with the
    `adapter` node (`framework.cli.construct`)."""
    try:
        return construct.build_model(node, runtime, construct.adapter_config(adapter))
    except InstantiationException:
        mismatch = _type_mismatch(node, "model")
        if mismatch:
            raise ConfigError(mismatch) from None
        raise


def _checked_optimizer(node: Any) -> Any:
    """The optimizer factory; a learning rate that is not a finite positive number is named."""
    optimizer = _instantiate(node, "optimizer")
    lr = getattr(optimizer, "keywords", {}).get("lr")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"optimizer.lr={lr}: must be a finite number > 0")
    return optimizer


def _optional(node: Any) -> Any:
    if node is None or (isinstance(node, DictConfig) and node.get("_target_") is None):
        return None
    return instantiate(node)


def _callbacks(cfg: DictConfig, out: Path, context: dict[str, Any], main: bool) -> list[Callback]:
    """Loggers and run files (rank 0 only: `main`), then the configured callbacks."""
    callbacks: list[Callback] = []
    if main:
        callbacks += [
            instantiate_with_context(node, context) for node in cfg.logger.values() if node is not None
        ]
        callbacks += [MetricsFile(out / "metrics.jsonl"), RunFiles(out)]
    callbacks += [
        instantiate_with_context(node, context) for node in cfg.callbacks.values() if node is not None
    ]
    return callbacks


def build_engine(cfg: DictConfig, runtime: Runtime, callbacks: list[Callback]) -> Engine:
    """The model (built as the strategy says) and everything the Engine is given, from `cfg`."""
    t = cfg.trainer
    model = _build_model(cfg.model, runtime, cfg.get("adapter"))
    objective = None
    if cfg.get("objective") is not None:  # +objective=dpo: a step over pairs in place of the loss
        options = OmegaConf.to_container(cfg.objective, resolve=True)
        objective = preference.objective_for(model, options)  # type: ignore[arg-type]
    return Engine(
        model,
        loss=instantiate(cfg.loss),
        optimizer=_checked_optimizer(cfg.optimizer),
        metrics={name: instantiate(node) for name, node in cfg.metrics.items()},
        scheduler=_optional(cfg.scheduler),
        train_step=objective or _optional(cfg.step),
        eval_step=objective.eval_step if objective else _optional(cfg.eval_step),
        callbacks=callbacks,
        seed=t.seed,
        prefetch=cfg.data.prefetch,
        runtime=runtime,
        label_key=cfg.data.label_key,
        output_key=t.output_key,
    )


def _fit(cfg: DictConfig, engine: Engine, splits: Any, ckpt_dir: Path) -> dict[str, list[Any]]:
    """Preemption handling, `trainer.init_from`, then `Engine.fit` (watched: `trainer.timeout_s`)."""
    t = cfg.trainer
    preempt = t.checkpoint.enabled and threading.current_thread() is threading.main_thread()
    if preempt:
        preemption.install_handler()
    main = engine.runtime.process.is_main
    resume = resume_choice(cfg, main)
    if t.init_from and not (
        resume and (resume != "auto" or checkpoint.find_resumable(ckpt_dir, engine.runtime.process))
    ):
        engine.prepare("train", int(t.batch_size))
        try:
            engine.load(str(t.init_from))  # a fresh start from these weights
        except (CheckpointError, FileNotFoundError) as exc:
            raise type(exc)(f"trainer.init_from={t.init_from}: {exc}") from None
        if isinstance(engine.train_step_fn, preference.DPO):  # the reference starts from them too
            engine.train_step_fn.follow(engine.runtime)
    kwargs = build_fit_config(cfg, ckpt_dir, preempt, resume, main).as_kwargs()
    if kwargs["collate_fn"] is None:  # the data's own (e.g. padding for text classification)
        kwargs["collate_fn"] = getattr(splits, "collate_fn", None)
    train, valid = splits.train, splits.valid
    if getattr(engine.train_step_fn, "precompute_reference", False):  # before a resume loads the policy
        engine.prepare("train", int(t.batch_size))
        chunk = max(1, int(t.batch_size) // engine.world_size)
        train = preference.with_reference_logps(engine, train, chunk, kwargs["collate_fn"])
        if valid is not None:
            valid = preference.with_reference_logps(engine, valid, chunk, kwargs["collate_fn"])
    return engine.fit(train, valid, **kwargs)


def _tokenizer_from_model_dir(cfg: DictConfig, main: bool = True) -> None:
    """`data.dataset.tokenizer` left unset and a model loaded from a directory that holds a
    tokenizer: that one (said in one line by rank 0, `main`; the saved config.yaml records it)."""
    node = cfg.data.dataset
    if "tokenizer" not in node or node.tokenizer is not None:
        return
    found = hf.tokenizer_dir(cfg.model)
    if found is not None:
        node.tokenizer = str(found)
        if main:
            print(f"data: the tokenizer of {found} (the model's directory; data.dataset.tokenizer to change)")


def train(cfg: DictConfig, output_dir: str | None, context: dict[str, Any] | None = None) -> float | None:
    """Train in this process (one rank of the job): build everything from `cfg`, fit, write files.
    The job's process context is made here and handed to the runtime; it ends with the job."""
    check_schema(cfg)
    t = cfg.trainer
    strategy = build_strategy(cfg)
    job = ProcessContext.start(str(t.accelerator), float(t.timeout_s), tf32=bool(t.tf32))
    with job, contextlib.ExitStack() as console_copy:
        runtime = Runtime(strategy, job)
        runtime.mesh  # noqa: B018  degrees that do not divide the processes: the strategy's own error
        _with_key("trainer.batch_size", runtime.fix_layout, int(t.batch_size))
        if launched():
            check_launched_devices(int(t.devices), job)
        out = Path(job.broadcast_object(output_dir or os.path.join("outputs", "run")))
        context = dict(context or {}, output_dir=str(out))
        if job.is_main:
            out.mkdir(parents=True, exist_ok=True)
            console_copy.enter_context(runlog.tee(Path(context.get("log_file") or out / "train.log")))
        _tokenizer_from_model_dir(cfg, job.is_main)
        context["run_config"] = OmegaConf.to_container(cfg, resolve=True)
        if job.is_main:
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        seed_everything(t.seed)
        splits = as_splits(instantiate(cfg.data.dataset))
        check_monitors(cfg, has_valid=getattr(splits, "valid", None) is not None)
        callbacks = _callbacks(cfg, out, context, job.is_main) if not cfg.dry_run else []
        engine = build_engine(cfg, runtime, callbacks)
        hf.adopt(engine.module, splits)  # the tokenizer fits the model; class names into its config
        if cfg.dry_run:
            if job.is_main:
                print_plan(engine)
            return None
        ckpt_dir = checkpoint_dir(cfg, out)
        if t.checkpoint.enabled:
            hf.keep_tokenizer(splits, ckpt_dir, write=job.is_main)
        history = _fit(cfg, engine, splits, ckpt_dir)
        if job.is_main and engine.state.stop_reason.startswith("preempted"):
            print(
                f"{engine.state.stop_reason}; resume with trainer.resume=auto trainer.checkpoint.dir={ckpt_dir}"
            )
        values = history.get(t.monitor)
        return float(values[-1]) if values else None
