"""Starting a job's processes with well-known launchers only.

* one process: the job runs in this process;
* `trainer.devices=N` on one machine: N workers started by torch's elastic launcher
  (`elastic_launch`, the engine behind torchrun), on a free port, each handed the resolved
  config and the output dir; this process returns rank 0's result;
* already launched (torchrun, the `deepspeed` launcher, Slurm through submitit): the process
  joins the group it was given and nothing is spawned.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from framework import device as dev
from framework.errors import ConfigError


class WorkerFailed(RuntimeError):
    """A worker process of this job failed; the message names the rank and carries its traceback."""

    def __init__(self, message: str, printed: bool = False):
        super().__init__(message)
        self.printed = printed  # the worker already printed a one-line reason


class Interrupted(RuntimeError):
    """The launching process got a signal; torch elastic passed it on to the workers (which save a
    checkpoint on SIGTERM, see framework.checkpoint) and waited for them."""

    def __init__(self, signum: int, since: float):
        super().__init__(f"interrupted by signal {signum}")
        self.signum, self.since = signum, since  # since: when the launch started


def join_slurm_tasks() -> None:
    """Inside a submitit/Slurm job with several tasks, export the rendezvous variables so the
    tasks join one process group (one task per device, any number of nodes)."""
    if dev.launched() or int(os.environ.get("SLURM_NTASKS", "1")) <= 1 or "SUBMITIT_FOLDER" not in os.environ:
        return
    import submitit

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def check_devices(devices: int) -> None:
    """`trainer.devices` must fit on this machine."""
    available = dev.local_device_count()
    if devices < 1 or devices > available:
        what = f"{available} GPU(s)" if dev.cuda_available() else f"{available} CPU core(s) and no GPU"
        raise ConfigError(
            f"trainer.devices={devices} but this machine has {what}; use trainer.devices<={available}, "
            "or start processes on several machines with torchrun (README: Scaling out)"
        )


def check_launched_devices(devices: int) -> None:
    """Under a launcher, `trainer.devices` (processes per machine) must agree with what it started
    on this machine; 1 (the default) always agrees."""
    local = dev.local_world_size()
    if devices not in (1, local):
        nodes = dev.world_size() // max(local, 1)
        where = f" on this machine ({dev.world_size()} in all)" if nodes > 1 else ""
        raise ConfigError(
            f"trainer.devices={devices} but the launcher started {local} processes{where}; "
            f"drop trainer.devices or set it to {local} (it counts processes per machine)"
        )


def _failure_text(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            name = ""
        return f"worker rank {rank} was killed by signal {-exitcode}{name}"
    return f"worker rank {rank} failed (exit code {exitcode})"


def spawn(entrypoint: Callable[..., Any], args: tuple[Any, ...], nproc: int, timeout_s: float = 300.0) -> Any:
    """Run `entrypoint(*args)` in `nproc` local workers under torch's elastic launcher and return
    rank 0's return value. A failing worker ends the job (the others are stopped) with a
    `WorkerFailed` naming its rank.

    The rendezvous store is one this process binds to a port the OS picks (held, not probed and
    released), so no other program can take the port between choosing and using it; the
    launcher's log dir is a temporary dir removed afterwards."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs a failing worker's traceback itself; WorkerFailed carries it once instead.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    log_dir = tempfile.mkdtemp(prefix="hydraspeed-launch-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hydraspeed-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{store.port}",
        rdzv_configs={"timeout": int(timeout_s), "is_host": False},  # join the store held above
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    # Workers inherit this process's environment: share the cores between them, for this launch only.
    threads_set = "OMP_NUM_THREADS" not in os.environ
    if threads_set:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    started = time.time()
    try:
        results = elastic_launch(config, entrypoint)(*args)
    except SignalException as exc:
        raise Interrupted(int(exc.sigval), started) from None
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        detail = (failure.error_file_data or {}).get("message", {})
        trace = (
            detail.get("extraInfo", {}).get("py_callstack", "") if isinstance(detail, dict) else str(detail)
        )
        if trace and trace != "<NONE>":  # an exception: its traceback, as the worker recorded it
            raise WorkerFailed(f"{_failure_text(rank, failure.exitcode)}:\n{trace}".rstrip()) from None
        raise WorkerFailed(_failure_text(rank, failure.exitcode), printed=failure.exitcode > 0) from None
    finally:
        if threads_set:
            os.environ.pop("OMP_NUM_THREADS", None)
        shutil.rmtree(log_dir, ignore_errors=True)
        del store
    return results[0]
