"""Hydra entry: a composed config becomes objects, objects become a run.

`train.py` is a few lines around `run(cfg)`. The straight line::

    prepare_argv -> Hydra composes conf/ -> run(cfg)
      -> launch (in-process, or N local workers)
      -> train(cfg, output_dir): data, model (inside zero.Init for ZeRO-3), loss, metrics,
         optimizer, scheduler, loggers -> Engine.fit -> files + the monitored value
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import re
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from framework import device as dev
from framework.callbacks import Callback, TrainState
from framework.checkpoint import install_preemption_handler
from framework.config import (
    GROUPS,
    check_group_choice,
    check_override,
    check_schema,
    check_untyped_keys,
    register_configs,
)
from framework.engine import Engine, model_init_context, strategy_for_this_machine
from framework.launch import (
    Interrupted,
    WorkerFailed,
    check_devices,
    check_launched_devices,
    join_slurm_tasks,
    spawn,
)
from framework.loggers import MetricsFile
from framework.loops import NonFiniteLoss
from framework.strategy import ConfigError, Strategy, batch_layout, deepspeed_config

register_configs()


# Top-level switches that exist in the schema but read naturally with a `+` (`+dry_run=true`).
FLAGS = ("dry_run",)


def normalize_overrides(overrides: list[str]) -> list[str]:
    """`+strategy=zero3` and `strategy=zero3` both select an option of a default group: Hydra
    accepts only one form per defaults-list entry, so the `+` of our own groups is dropped
    (and of the switches in FLAGS, which always exist)."""
    out = []
    for item in overrides:
        if item.startswith("+") and not item.startswith("++"):
            key = item[1:].split("=", 1)[0]
            if key in GROUPS or key in FLAGS:
                item = item[1:]
        out.append(item)
    return out


def prepare_argv(argv: list[str] | None = None) -> None:
    """Rewrite `sys.argv` before Hydra parses it.

    * `+group=x` -> `group=x` for our groups (both forms work).
    * `--local_rank=N` from the `deepspeed` launcher is dropped (LOCAL_RANK carries it).
    * overrides of typed keys are checked first, so a typo names the nearest key.
    * On ranks > 0 of a job started by a launcher (torchrun, deepspeed, srun), Hydra must not
      create a second output dir or log file: rank 0's dir is shared with them after the
      process group forms.
    """
    argv = sys.argv if argv is None else argv
    # The `deepspeed` launcher appends --local_rank=N (also in LOCAL_RANK); Hydra cannot parse it.
    argv[1:] = [a for a in argv[1:] if not a.startswith(("--local_rank=", "--local-rank="))]
    argv[1:] = normalize_overrides(argv[1:])
    conf_dir = Path(argv[0]).resolve().parent / "conf"
    try:
        for item in argv[1:]:
            if not item.startswith("-"):
                check_override(item)
                check_group_choice(item, conf_dir)
        check_untyped_keys(argv[1:], conf_dir)
    except ConfigError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"Error: {exc}", file=sys.stderr)
        sys.exit(1)
    if dev.launched() and int(os.environ.get("RANK", "0")) > 0:
        argv.extend(["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"])


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def hydra_output_dir() -> str | None:
    """This job's output dir when running under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.output_dir)
    return None


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


# Mistakes in a config or its inputs: reported in a line or two, without a traceback.
USER_ERRORS = (ConfigError, InstantiationException, FileNotFoundError, NonFiniteLoss)


def _verbose(cfg: DictConfig) -> bool:
    return bool(cfg.trainer.verbose) or os.environ.get("HYDRA_FULL_ERROR") == "1"


def run(cfg: DictConfig) -> float | None:
    """Run one job from a composed config; return the monitored value (for sweepers)."""
    verbose = _verbose(cfg)
    dev.quiet_deepspeed(verbose)
    try:
        return launch_job(cfg, hydra_output_dir() or default_output_dir())
    except USER_ERRORS as exc:
        if verbose:
            traceback.print_exc()
        return _fail(_explain(exc), show=dev.rank() == 0 or not isinstance(exc, ConfigError))
    except WorkerFailed as exc:
        return _fail(str(exc), show=not exc.printed)
    except Interrupted as exc:
        # SIGTERM is preemption: the workers saved and rank 0 said where. Leave at once: the
        # launcher's rendezvous store can still hold C++ threads that abort an ordinary
        # interpreter exit ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if exc.signum == signal.SIGTERM else 128 + exc.signum)


def _fail(message: str, show: bool) -> float:
    """Say what failed (once) and end this job: exit 1; in a sweep, the job's objective is NaN,
    the sweep goes on, and the sweep summary names the job and exits non-zero at the end."""
    if show:
        print(f"Error: {message}", file=sys.stderr)
    if _is_multirun():
        return math.nan
    sys.exit(1)


def default_output_dir() -> str:
    """Where a run outside Hydra writes: outputs/DATE/TIME, like Hydra's default."""
    import datetime

    now = datetime.datetime.now()
    return os.path.join("outputs", now.strftime("%Y-%m-%d"), now.strftime("%H-%M-%S"))


def launch_job(cfg: DictConfig, output_dir: str) -> float | None:
    """Run the job here, in N local workers, or as one rank of a launcher's group."""
    join_slurm_tasks()
    devices = int(cfg.trainer.devices)
    context = sweep_context()
    if dev.launched() or devices == 1:
        return train(cfg, output_dir, context)
    check_devices(devices)
    validate(cfg, world_size=devices)  # fail here, before starting workers
    container = OmegaConf.to_container(cfg, resolve=True)  # workers have no Hydra state
    return spawn(
        worker_main, (container, output_dir, context), devices, timeout_s=float(cfg.trainer.timeout_s)
    )


@record
def worker_main(container: dict[str, Any], output_dir: str, context: dict[str, Any]) -> float | None:
    """One worker of a `trainer.devices=N` job (runs in a fresh process)."""
    cfg = OmegaConf.create(container)
    dev.quiet_deepspeed(_verbose(cfg))
    try:
        return train(cfg, output_dir, context)
    except USER_ERRORS as exc:
        if _verbose(cfg):
            traceback.print_exc()
        if dev.rank() == 0 or not isinstance(exc, ConfigError):
            print(f"Error: {_explain(exc)}", file=sys.stderr, flush=True)
        sys.exit(1)


def validate(cfg: DictConfig, world_size: int) -> Strategy:
    """Checks that need no process group: schema, strategy, batch split over `world_size`."""
    check_schema(cfg)
    strategy = Strategy.from_config(cfg.strategy)
    batch_layout(strategy, int(cfg.trainer.batch_size), world_size)
    return strategy


def _explain(exc: BaseException) -> str:
    """One to three lines: what is wrong and, where we can tell, what to write instead."""
    if isinstance(exc, InstantiationException):
        text = str(exc).strip()
        located = re.search(r"Error locating target '([^']+)'", text)
        full_key = re.search(r"full_key: (\S+)", text)
        where = f"{full_key.group(1)}._target_" if full_key else "_target_"
        if located:
            root = exc
            while root.__cause__ is not None:
                root = root.__cause__  # type: ignore[assignment]
            reason = str(root).splitlines()[0] if root is not exc else ""
            missing = re.search(r"No module named '[^']+'", str(exc.__cause__))
            reason = missing.group(0) if missing else reason
            return f"{where}={located.group(1)} cannot be imported: {reason}; check the module path and name"
        cause = exc.__cause__
        if isinstance(cause, (FileNotFoundError, ConfigError)):
            return f"{cause} (in {full_key.group(1) if full_key else 'the config'})"
        first = text.splitlines()[0] if text else type(exc).__name__
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        return f"{first}{detail}"
    return str(exc)


class RunFiles(Callback):
    """Rank 0 writes the DeepSpeed config that the engine really received, then the final metrics."""

    def __init__(self, output_dir: Path, monitor: str):
        self.output_dir, self.monitor = output_dir, monitor

    def on_fit_start(self, state: TrainState) -> None:
        """deepspeed_config.json next to the resolved config."""
        assert state.engine is not None
        with open(self.output_dir / "deepspeed_config.json", "w") as f:
            json.dump(state.engine.deepspeed_config, f, indent=2)

    def on_fit_end(self, state: TrainState) -> None:
        """final_metrics.json: the last value of each logged quantity."""
        final = {k: v[-1] for k, v in state.history.items() if v}
        final.update(step=state.global_step, batches=state.batches_fetched, samples=state.samples_seen)
        with open(self.output_dir / "final_metrics.json", "w") as f:
            json.dump(final, f, indent=2, default=float)


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


def sweep_context() -> dict[str, Any]:
    """In a Hydra multirun: the sweep (wandb group) and this job's overrides (run name)."""
    from hydra.core.hydra_config import HydraConfig

    if not _is_multirun():
        return {}
    hc = HydraConfig.get()
    return {"group": Path(str(hc.sweep.dir)).name, "name": str(hc.job.override_dirname) or f"job{hc.job.num}"}


def _instantiate_optional(node: Any) -> Any:
    if node is None or (isinstance(node, DictConfig) and node.get("_target_") is None):
        return None
    return instantiate(node)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_plan(model: Any, strategy: Strategy, cfg: DictConfig) -> None:
    """What `+dry_run=true` prints: per-rank model-state memory and the DeepSpeed config."""
    engine = Engine(model, optimizer=instantiate(cfg.optimizer), strategy=strategy)
    cost = engine.cost("train")
    print(
        f"{type(model).__name__}: {cost['parameters']:,} parameters (largest tensor {cost['largest_parameter']:,}) | "
        f"{strategy.describe()} | {dev.world_size()} process(es), {cost['data_parallel_size']} data-parallel"
    )
    print(
        "per-rank model states: "
        + ", ".join(
            f"{k.removesuffix('_bytes')} {_size(cost[k])}"
            for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "buffer_bytes")
        )
        + f" = {_size(cost['total_bytes'])} (device {_size(cost['device_bytes'])}, cpu {_size(cost['cpu_bytes'])})"
    )
    if cost["deepspeed_estimate"]:
        est = cost["deepspeed_estimate"]
        print(
            f"DeepSpeed's estimator (fp16 mixed precision): device {_size(est['device_bytes'])}, cpu {_size(est['cpu_bytes'])}"
        )
    numel, largest = cost["parameters"], cost["largest_parameter"]
    config = deepspeed_config(strategy, cfg.trainer.batch_size, dev.world_size(), numel, largest)
    print("DeepSpeed config: " + json.dumps(config))


def train(cfg: DictConfig, output_dir: str | None, context: dict[str, Any] | None = None) -> float | None:
    """Train in this process (one rank of the job): build everything from `cfg`, fit, write files."""
    check_schema(cfg)
    t = cfg.trainer
    strategy = strategy_for_this_machine(Strategy.from_config(cfg.strategy))
    with dev.process_group(timeout_s=t.timeout_s):
        batch_layout(strategy, int(t.batch_size), dev.world_size())
        if dev.launched():
            check_launched_devices(int(t.devices))
        out = Path(dev.broadcast_object(output_dir or os.path.join("outputs", "run")))
        main = dev.is_main_process()
        context = dict(
            context or {}, output_dir=str(out), run_config=OmegaConf.to_container(cfg, resolve=True)
        )
        if main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        seed_everything(t.seed)
        splits = instantiate(cfg.data.dataset)
        preview = deepspeed_config(strategy, t.batch_size, dev.world_size())
        with model_init_context(strategy, preview):
            model = instantiate(cfg.model)
        if cfg.dry_run:
            if main:
                print_plan(model, strategy, cfg)
            return None
        callbacks: list[Callback] = []
        if main:
            loggers = [
                instantiate_with_context(node, context) for node in cfg.logger.values() if node is not None
            ]
            callbacks += loggers + [MetricsFile(out / "metrics.jsonl"), RunFiles(out, t.monitor)]
        callbacks += [
            instantiate_with_context(node, context) for node in cfg.callbacks.values() if node is not None
        ]
        engine = Engine(
            model,
            loss=instantiate(cfg.loss),
            optimizer=instantiate(cfg.optimizer),
            metrics={name: instantiate(node) for name, node in cfg.metrics.items()},
            strategy=strategy,
            scheduler=_instantiate_optional(cfg.scheduler),
            train_step=_instantiate_optional(cfg.step),
            eval_step=_instantiate_optional(cfg.eval_step),
            callbacks=callbacks,
            seed=t.seed,
            prefetch=cfg.data.prefetch,
        )
        ckpt_dir = Path(t.checkpoint.dir) if t.checkpoint.dir else out / "checkpoints"
        if t.checkpoint.enabled and threading.current_thread() is threading.main_thread():
            install_preemption_handler()
            engine.handle_preemption = True
        history = engine.fit(
            splits.train,
            splits.valid,
            epochs=t.epochs,
            batch_size=t.batch_size,
            steps_per_epoch=t.steps_per_epoch,
            valid_freq=t.valid_every,
            valid_at_start=t.valid_at_start,
            log_freq=t.log_every,
            max_steps=t.max_steps,
            valid_batch_size=t.valid_batch_size,
            shuffle=cfg.data.shuffle,
            num_workers=cfg.data.num_workers,
            save_dir=str(ckpt_dir) if t.checkpoint.enabled else None,
            save_freq=t.checkpoint.every_n_steps,
            keep_last_k=t.checkpoint.keep_last_k,
            resume=t.resume,
        )
        if main and engine.state.stop_reason.startswith("preempted"):
            print(
                f"{engine.state.stop_reason}; resume with trainer.resume=auto trainer.checkpoint.dir={ckpt_dir}"
            )
        values = history.get(t.monitor)
        return float(values[-1]) if values else None
