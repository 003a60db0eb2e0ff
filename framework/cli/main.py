"""Hydra entry: launching, and the error text a user sees.

`train.py` is a few lines around `run(cfg)`. The straight line::

    prepare_argv (framework.cli.startup) -> Hydra composes conf/ -> run(cfg)
      -> launch (in-process, or N local workers)
      -> framework.build(cfg, output_dir).fit() (framework.cli.build.train) -> the monitored value
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from framework.backend import deepspeed_globals
from framework.checkpoint import preemption
from framework.cli import autotune, sweep
from framework.cli.build import train, tree
from framework.cli.config import register_configs
from framework.errors import CheckpointError, ConfigError, NonFiniteLoss
from framework.observe import runlog
from framework.process import slurm, watchdog
from framework.process.environment import choose_accelerator, env_rank, launched
from framework.process.launch import Interrupted, WorkerFailed, check_devices, join_slurm_tasks, spawn
from framework.recipe import validate
from framework.recipe.options import checkpoint_dir

register_configs()


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
USER_ERRORS = (ConfigError, CheckpointError, InstantiationException, FileNotFoundError, NonFiniteLoss)


def _verbose(cfg: DictConfig) -> bool:
    return bool(cfg.trainer.verbose) or os.environ.get("HYDRA_FULL_ERROR") == "1"


def run(cfg: DictConfig) -> float | None:
    """Run one job from a composed config; return the monitored value (for sweepers)."""
    verbose = _verbose(cfg)
    output_dir = hydra_output_dir() or default_output_dir()
    if env_rank() == 0:
        sweep.clear_status(Path(output_dir))
    try:
        value = launch_job(cfg, output_dir)
    except USER_ERRORS as exc:
        if verbose:
            traceback.print_exc()
        return _fail(_explain(exc), show=env_rank() == 0 or not isinstance(exc, ConfigError))
    except WorkerFailed as exc:
        return _fail(str(exc), show=not exc.printed)
    except Interrupted as exc:
        # A preemption signal the workers did not survive: 75 or 0 when they saved for it or had
        # finished, else 1 naming the last good checkpoint; INT, HUP, QUIT: 128 + the signal. Leave
        # at once: the launcher's rendezvous store can hold C++ threads that abort a normal exit.
        code, ckpt_dir = 128 + exc.signum, checkpoint_dir(tree(cfg), output_dir)
        if exc.signum in preemption.SIGNALS:
            preemption.note_requested(exc.since, exc.signum)
            code = preemption.exit_code(ckpt_dir, exc.since)
            if code in (0, preemption.EXIT_PREEMPTED) and env_rank() == 0:
                sweep.write_status(Path(output_dir), "ok" if code == 0 else "preempted")
        else:
            _say_interrupted(exc.signum, ckpt_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except RuntimeError as exc:  # after Interrupted and WorkerFailed, which are RuntimeErrors too
        failure = peer_failure(exc)
        if failure is None:
            raise
        if verbose:
            traceback.print_exc()
        return _fail(failure, show=True)
    except KeyboardInterrupt:  # Ctrl-C on a run in this process: no traceback, the way to go on
        _say_interrupted(signal.SIGINT, checkpoint_dir(tree(cfg), output_dir))
        sys.exit(130)
    if preemption.saved_step() is not None:
        return _end_preempted(Path(output_dir))
    if env_rank() == 0:
        sweep.write_status(Path(output_dir), "ok")
    return value


def _end_preempted(output_dir: Path) -> float:
    """A preempted run that saved: exit `EXIT_PREEMPTED` (every rank) for the job script to
    requeue; under submitit, a USR1/USR2 goes on to submitit's own handler, which requeues the job
    (and ends the process itself). A submitit job that is not requeued returns NaN instead, so
    submitit records a result and the sweep's summary (which reads the status written here)
    names it. A local sweep ends: the signal was for the whole process."""
    main = env_rank() == 0
    requeue = preemption.submitit_requeue()
    if main:
        sweep.write_status(output_dir, "requeued" if requeue else "preempted")
    if requeue is not None:
        try:
            requeue()  # submitit requeues the job and exits; rank > 0 returns
        except Exception as exc:  # submitit would not requeue (e.g. max_num_timeout reached)
            if main:
                print(f"Error: not requeued: {exc}", file=sys.stderr)
                sweep.write_status(output_dir, "preempted")
    if slurm.under_submitit() and _is_multirun():
        return math.nan
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(preemption.EXIT_PREEMPTED)


def _say_interrupted(signum: int, ckpt_dir: Path) -> None:
    """Rank 0: which signal ended the run, its last checkpoint and how to go on from it."""
    if env_rank() == 0:
        last = preemption.last_checkpoint(ckpt_dir)
        again = (
            f"; resume with trainer.resume=auto trainer.checkpoint.dir={ckpt_dir}" if last != "none" else ""
        )
        print(f"interrupted ({signal.Signals(signum).name}); last checkpoint: {last}{again}", file=sys.stderr)


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
    accelerator = choose_accelerator(str(cfg.trainer.accelerator))
    deepspeed_globals.quiet(_verbose(cfg), accelerator)  # before DeepSpeed's first import says anything
    if cfg.get("autotune") is not None and not cfg.dry_run:
        validate(tree(cfg), world_size=int(cfg.trainer.devices))
        tuned = autotune.tune_job(cfg, output_dir)  # the fastest layout that fits, by trials
        if tuned is None:
            return None
        cfg = tuned
    devices = int(cfg.trainer.devices)
    context = dict(sweep_context(), log_file=runlog.hydra_log_file())  # rank 0 copies its console there
    if launched() or devices == 1:
        return train(cfg, output_dir, context)
    check_devices(devices, accelerator)
    validate(tree(cfg), world_size=devices)  # fail here, before starting workers
    container = OmegaConf.to_container(cfg, resolve=True)  # workers have no Hydra state
    value, report = spawn(
        worker_main, (container, output_dir, context), devices, timeout_s=float(cfg.trainer.timeout_s)
    )
    if not _is_multirun():  # the workers are done: a late signal must not kill the launcher now
        preemption.install_handler()
    preemption.adopt(report)  # rank 0's: the launcher exits as a preempted worker would
    return value


@record
def worker_main(container: dict[str, Any], output_dir: str, context: dict[str, Any]) -> tuple[Any, ...]:
    """One worker of a `trainer.devices=N` job (runs in a fresh process): its monitored value and
    whether it stopped for preemption (`preemption.report()`), returned to the launcher, which
    collects every worker's return value before the job ends, preempted or not."""
    cfg = OmegaConf.create(container)
    try:
        deepspeed_globals.quiet(_verbose(cfg), choose_accelerator(str(cfg.trainer.accelerator)))
        return train(cfg, output_dir, context), preemption.report()
    except USER_ERRORS as exc:
        if _verbose(cfg):
            traceback.print_exc()
        if env_rank() == 0 or not isinstance(exc, ConfigError):
            print(f"Error: {_explain(exc)}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as exc:
        failure = peer_failure(exc)
        if failure is None:
            raise
        print(f"Error: {failure}", file=sys.stderr, flush=True)
        _let_the_cause_fail_first()
        sys.exit(1)
    except KeyboardInterrupt:  # SIGINT: torch's process wrapper would exit 0 without a result
        sys.exit(130)


def _let_the_cause_fail_first(grace_s: float = 5.0) -> None:
    """Wait (at most `grace_s`, or until the launcher's SIGTERM): the launcher names the first rank to
    exit, which should be the one that raised (its traceback), not this one its teardown failed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and preemption.requested_at() is None:
        time.sleep(0.05)


# What gloo says when the other end of a collective stopped, died or never came.
PEER_SIGNS = (
    "Application timeout",
    "Timed out",
    "timed out",
    "Connection closed by peer",
    "Connection reset by peer",
)


def peer_failure(exc: BaseException) -> str | None:
    """One line for a collective that failed because another rank stopped, died or is stuck (a
    stopped peer on this host is named and ended); None for any other error."""
    import torch.distributed as dist

    text = str(exc).strip()
    if not (isinstance(exc, dist.DistError) or any(sign in text for sign in PEER_SIGNS)):
        return None
    first = text.splitlines()[0] if text else type(exc).__name__
    return (
        f"rank {env_rank()}: a collective with the other ranks failed ({type(exc).__name__}: {first}): another "
        f"rank stopped, died or is stuck (trainer.timeout_s bounds the wait){watchdog.end_stopped_peers()}"
    )


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


def sweep_context() -> dict[str, Any]:
    """In a Hydra multirun: the sweep (wandb group) and this job's overrides (run name)."""
    from hydra.core.hydra_config import HydraConfig

    if not _is_multirun():
        return {}
    hc = HydraConfig.get()
    return {"group": Path(str(hc.sweep.dir)).name, "name": str(hc.job.override_dirname) or f"job{hc.job.num}"}
