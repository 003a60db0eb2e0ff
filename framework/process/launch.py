"""Starting a job's processes with well-known launchers only.

* one process: the job runs in this process;
* `trainer.devices=N` on one machine: N workers started by torch's elastic launcher
  (`elastic_launch`, the engine behind torchrun), on a free port, each handed the resolved
  config and the output dir; this process returns rank 0's result;
* already launched (torchrun, the `deepspeed` launcher, an `srun` step of several tasks, Slurm
  through submitit): the process joins the group it was given and nothing is spawned.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from framework.errors import ConfigError
from framework.process import slurm
from framework.process.context import ProcessContext
from framework.process.environment import env_rank, env_world_size, launched, local_device_count


class WorkerFailed(RuntimeError):
    """A worker process of this job failed; the message names the rank and carries its traceback."""

    def __init__(self, message: str, printed: bool = False):
        super().__init__(message)
        self.printed = printed  # the worker already printed a one-line reason


class Interrupted(RuntimeError):
    """The launching process got a stop signal (INT, HUP, QUIT), passed it on to the workers and
    waited for them (TERM, USR1 and USR2 are preemption instead: see `PREEMPT_SIGNALS`)."""

    def __init__(self, signum: int, since: float):
        super().__init__(f"interrupted by signal {signum}")
        self.signum, self.since = signum, since  # since: when the launch started


def join_slurm_tasks() -> str | None:
    """Inside a Slurm step with several tasks, export the rendezvous variables so the tasks join
    one process group (one task per device, any number of nodes): from submitit's helper under
    Hydra's submitit launcher, else from Slurm's own variables (plain `srun`). Nothing when a
    launcher (torchrun, the `deepspeed` launcher) already set ranks. Returns how it joined."""
    if launched():
        return None
    if slurm.under_submitit() and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        how = "submitit"
    else:
        variables = slurm.rendezvous_from_slurm(os.environ)
        if variables is None:
            return None
        os.environ.update(variables)
        how = "srun"
    if env_rank() == 0:
        print(
            f"slurm: {env_world_size()} tasks of job {os.environ.get('SLURM_JOB_ID')} joined one group "
            f"({how}; rank from SLURM_PROCID, master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})",
            flush=True,
        )
    return how


def check_devices(devices: int, accelerator: str) -> None:
    """`trainer.devices` must fit on this machine (`accelerator`: "cuda" counts GPUs, "cpu" cores)."""
    available = local_device_count(accelerator)
    if devices < 1 or devices > available:
        what = f"{available} GPU(s)" if accelerator == "cuda" else f"{available} CPU core(s) and no GPU"
        raise ConfigError(
            f"trainer.devices={devices} but this machine has {what}; use trainer.devices<={available}, "
            "or start processes on several machines with torchrun (docs: how-to/launchers.md)"
        )


def check_launched_devices(devices: int, process: ProcessContext) -> None:
    """Under a launcher, `trainer.devices` (processes per machine) must agree with what it started
    on this machine; 1 (the default) always agrees."""
    local, world = process.local_world_size, process.world_size
    if devices not in (1, local):
        nodes = world // max(local, 1)
        where = f" on this machine ({world} in all)" if nodes > 1 else ""
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
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
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
    _start_resource_tracker()
    try:
        results = _run_forwarding_signals(lambda: elastic_launch(config, entrypoint)(*args), started)
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


# Signals the launching process passes on to its workers. TERM, USR1 and USR2 ask for a checkpoint:
# the workers save at the next step boundary and return, and their results are collected as
# usual. INT, HUP and QUIT end the job: the workers get the signal, and SIGKILL after STOP_GRACE_S.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
STOP_GRACE_S = 30.0


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, which the workers share, ignoring USR1 and USR2 as
    it ignores INT and TERM (an ignored signal stays ignored in the process it execs). Slurm signals
    every process of the job: a tracker killed by USR1 was relaunched by the next process that
    used it, which printed a KeyError traceback for each resource it had never seen."""
    from multiprocessing import resource_tracker

    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        resource_tracker.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _workers() -> list[Any]:
    """This process's worker processes (not multiprocessing's resource tracker, which a USR1 would kill)."""
    import psutil

    workers = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            tracker = any("resource_tracker" in part for part in child.cmdline())
            if not tracker and child.status() != psutil.STATUS_ZOMBIE:
                workers.append(child)
    return workers


def _run_forwarding_signals(launch: Callable[[], Any], started: float) -> Any:
    """Run torch elastic's `launch` in a thread (so it installs no signal handlers of its own) while
    this, the main thread, passes signals on to the workers. Torch elastic's own handling would
    stop the workers on SIGTERM and stop collecting their results: a worker that saved and
    returned would then wait for a launcher that no longer listens (or, when only the workers
    were signalled, the launcher would wait for a result never sent)."""
    box: dict[str, Any] = {}
    got: list[int] = []

    def target() -> None:
        try:
            box["result"] = launch()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            box["error"] = exc

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        for worker in _workers():
            with contextlib.suppress(Exception):
                worker.send_signal(signum)

    thread = threading.Thread(target=target, name="hydraspeed-launch", daemon=True)
    previous = {sig: signal.signal(sig, forward) for sig in PREEMPT_SIGNALS + STOP_SIGNALS}
    try:
        thread.start()
        stop_at = math.inf
        while thread.is_alive():
            thread.join(0.1)
            if stop_at == math.inf and any(sig in STOP_SIGNALS for sig in got):
                stop_at = time.monotonic() + STOP_GRACE_S
            if time.monotonic() > stop_at:  # stopping: the workers had their grace period
                for worker in _workers():
                    with contextlib.suppress(Exception):
                        worker.kill()
                break  # (torch elastic may still wait for a return value that never comes)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stopping = [sig for sig in got if sig in STOP_SIGNALS]
    if stopping or (got and "error" in box):  # the workers did not survive the signal
        raise Interrupted((stopping or got)[0], started)
    if "error" in box:
        raise box["error"]
    return box["result"]
