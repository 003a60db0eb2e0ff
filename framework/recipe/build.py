"""`framework.build(config, output_dir)`: a config tree becomes a run, the one place where the
policy of building one lives (the CLI's `python train.py` is `build(cfg, output_dir).fit()`).

One rank's build, a straight line::

    the tree (defaults filled in, checked) -> the job's process context -> Runtime(strategy) with
    the batch layout fixed -> output dir, console copy, tokenizer from the model's directory,
    config.yaml -> data -> loggers and callbacks -> model (built as the strategy says, adapted),
    method (`objective`), loss, optimizer, ... -> Engine -> fit options (resume choice) -> Run

Under a launcher (torchrun, srun, deepspeed) every rank calls it with the same tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from framework.backend.runtime import Runtime
from framework.data.datasets import as_splits
from framework.engine.construct import check_adapted
from framework.engine.engine import Engine
from framework.errors import ConfigError
from framework.integrations import hf
from framework.integrations.peft import AdapterConfig
from framework.methods import method_class
from framework.observe import runlog
from framework.plan.run_plan import batch_layout, mesh_of
from framework.plan.strategy import Strategy
from framework.process.context import ProcessContext, launched
from framework.process.launch import check_launched_devices
from framework.recipe import options
from framework.recipe.model import build_model
from framework.recipe.outputs import write_config
from framework.recipe.run import Run
from framework.recipe.schema import MISSING, RunConfig
from framework.recipe.targets import instantiate
from framework.recipe.tree import check, plain


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _defaults(schema: type) -> dict[str, Any]:
    """The tree of `schema`'s defaults (a dataclass, its typed sub-nodes as trees)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            is_node = dataclasses.is_dataclass(value) and not isinstance(value, type)
            out[f.name] = dataclasses.asdict(value) if is_node else value  # type: ignore[arg-type]
        else:
            out[f.name] = f.default
    return out


def _merged(base: Any, over: Any) -> Any:
    """`over` on top of `base`, dicts merged key by key."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in over.items()}}
    return over


def tree_of(config: Any) -> dict[str, Any]:
    """`config` as a checked plain tree, the schema's defaults under what it gives (a run's
    saved config.yaml gives everything; a dict, what it wants changed)."""
    given = plain(config)
    if not isinstance(given, dict):
        raise ConfigError(
            f"framework.build takes a config tree (a dict or an OmegaConf config), got {type(given).__name__}"
        )
    tree = _merged(_defaults(RunConfig), given)
    if tree["loss"] == MISSING:
        tree["loss"] = None  # a run with a method or a step of its own needs none
    check(tree)
    return tree


def strategy_of(tree: dict[str, Any]) -> Strategy:
    """The run's `Strategy` from the `strategy` node (validated)."""
    return Strategy.from_config(tree["strategy"])


def method_of(tree: dict[str, Any]) -> Any:
    """The training method the `objective` node names (with its options), or None."""
    if tree.get("objective") is None:
        return None
    node = dict(tree["objective"])
    name = str(node.pop("name", MISSING))
    if name == MISSING:
        raise ConfigError(
            "objective.name is required: a method's name (dpo, grpo, ...) or the import path of your Method "
            "subclass (objective.name=my_pkg.MyMethod)"
        )
    return options.made("objective", method_class(name), node)


def rows_of(method: Any, batch_size: int) -> int:
    """The data rows of a global batch (a method may count its batch in other units: GRPO's
    counts completions), the error naming `trainer.batch_size`."""
    rows = getattr(method, "rows_per_batch", None)
    return options.with_key("trainer.batch_size", rows, batch_size) if callable(rows) else batch_size


def validate(config: Any, world_size: int) -> Strategy:
    """Checks that need no process group (before workers start): schema, strategy, the method's
    options, batch split over `world_size`, a parallelism adapters do not support."""
    tree = tree_of(config)
    strategy = strategy_of(tree)
    mesh_of(strategy, world_size)  # degrees that do not divide the processes: the strategy's own error
    rows = rows_of(method_of(tree), int(tree["trainer"]["batch_size"]))
    options.with_key("trainer.batch_size", batch_layout, strategy, rows, world_size)
    if tree.get("adapter") is not None:
        check_adapted(strategy)
    return strategy


def build(
    config: Any,
    output_dir: str | os.PathLike | None = None,
    *,
    group: str | None = None,
    name: str | None = None,
    log_file: str | None = None,
) -> Run:
    """The run `config` describes (a dict, an OmegaConf config, a run's saved `config.yaml`
    loaded with `OmegaConf.load`), writing under `output_dir` (default `outputs/run`): its
    `fit()` trains exactly what `python train.py` trains with that config. `group` and `name`
    label it for trackers (a sweep and its job); `log_file` takes rank 0's console copy
    (default `<output_dir>/train.log`). Every rank of a job calls it."""
    tree = tree_of(config)
    t = tree["trainer"]
    job = ProcessContext.start(str(t["accelerator"]), float(t["timeout_s"] or 300.0), tf32=bool(t["tf32"]))
    console = contextlib.ExitStack()
    try:
        runtime = Runtime(strategy_of(tree), job)
        runtime.mesh  # noqa: B018  degrees that do not divide the processes: the strategy's own error
        method = method_of(tree)
        options.with_key("trainer.batch_size", runtime.fix_layout, rows_of(method, int(t["batch_size"])))
        if launched():
            check_launched_devices(int(t["devices"]), job)
        out = Path(job.broadcast_object(str(output_dir or os.path.join("outputs", "run"))))
        if job.is_main:
            out.mkdir(parents=True, exist_ok=True)
            console.enter_context(runlog.tee(Path(log_file or out / "train.log")))
        options.tokenizer_from_model_dir(tree, job.is_main)
        if job.is_main:
            write_config(tree, out)
        context = {"output_dir": str(out), "run_config": tree, "group": group, "name": name}
        run = _assemble(tree, runtime, out, context, method)
    except BaseException:
        console.close()
        job.close(sync=False)
        raise
    run.console, run.job = console, job
    return run


def _assemble(tree: dict[str, Any], runtime: Runtime, out: Path, context: dict[str, Any], method: Any) -> Run:
    """Data, callbacks, the engine and the fit options of a started run."""
    seed_everything(int(tree["trainer"]["seed"]))
    splits = as_splits(instantiate(tree["data"]["dataset"], "data.dataset"))
    valid = getattr(splits, "valid", None)
    monitor = options.monitor_of(tree, has_valid=valid is not None, say=runtime.process.is_main)
    callbacks = [] if tree["dry_run"] else options.callbacks_of(tree, out, context)
    engine = build_engine(tree, runtime, callbacks, method)
    hf.adopt(engine.module, splits)  # the tokenizer fits the model; class names into its config
    ckpt_dir = options.checkpoint_dir(tree, out)
    if tree["trainer"]["checkpoint"]["enabled"]:
        hf.keep_tokenizer(splits, ckpt_dir, write=runtime.process.is_main)
    fit = options.fit_options(tree, ckpt_dir, getattr(splits, "collate_fn", None), runtime.process.is_main)
    return Run(tree, engine, splits.train, valid, fit, out, monitor)


def build_engine(tree: dict[str, Any], runtime: Runtime, callbacks: list[Any], method: Any = None) -> Engine:
    """The model (built as the strategy says, adapted), its method (`+objective=NAME`, in place of
    `loss=`; `method`: made already) and everything the Engine is given, from the tree."""
    adapter = tree.get("adapter")
    model = build_model(tree["model"], runtime, AdapterConfig(**adapter) if adapter is not None else None)
    method = method if method is not None else method_of(tree)
    t, data = tree["trainer"], tree["data"]
    return Engine(
        model,
        loss=instantiate(tree["loss"], "loss"),
        optimizer=options.checked_optimizer(tree["optimizer"]),
        metrics={name: instantiate(node, f"metrics.{name}") for name, node in tree["metrics"].items()},
        scheduler=instantiate(tree["scheduler"], "scheduler"),
        train_step=method or instantiate(tree["step"], "step"),
        eval_step=instantiate(tree["eval_step"], "eval_step"),
        callbacks=callbacks,
        seed=int(t["seed"]),
        prefetch=int(data["prefetch"]),
        runtime=runtime,
        label_key=str(data["label_key"]),
        output_key=t["output_key"],
    )
