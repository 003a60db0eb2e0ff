"""Device, backend and process-group handling: the one place that knows CUDA from CPU.

Everything else asks this module for `device()`, `backend()`, `rank()` and friends, so a
run is correct on CUDA (nccl, one GPU per local rank) and on a laptop CPU (gloo, DeepSpeed's
CPU accelerator) without a branch anywhere else.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import logging
import os
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from framework.backend import deepspeed_globals
from framework.process import watchdog
from framework.process.allocator import tune_host_allocator

# Environment variables this process set itself for a launcher-less single process; removed on teardown.
_owned_env: list[str] = []
_replaced_env: dict[str, str] = {}  # launcher values this process overwrote; restored on teardown
_we_initialized = False
_accelerator: str | None = None  # "cuda" or "cpu", once decided


def _gpu_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def select_accelerator(choice: str = "auto") -> str:
    """Decide where this process computes, once, and tell DeepSpeed the same (DS_ACCELERATOR).

    auto: CUDA when torch sees a GPU, unless DS_ACCELERATOR=cpu says otherwise (a GPU this torch
    cannot use is said in one line); cpu: the CPU even on a GPU machine; cuda: CUDA, or a
    ConfigError when torch sees none. Call it before DeepSpeed is first used."""
    global _accelerator
    from framework.errors import ConfigError

    if choice not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.accelerator={choice}: use auto, cpu or cuda")
    if choice == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(
            f"trainer.accelerator=cuda, but torch {torch.__version__} ({build}) sees no CUDA device; "
            "install a CUDA build of torch, check CUDA_VISIBLE_DEVICES, or use trainer.accelerator=cpu"
        )
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else "cpu"
        if choice == "cpu" and not torch.cuda.is_available() and _gpu_present() and _accelerator is None:
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    f"accelerator: this machine has a GPU but torch {torch.__version__} cannot use it; training "
                    "on the CPU (install a CUDA build of torch, or set trainer.accelerator=cpu to silence this)",
                    file=sys.stderr,
                )
    if _accelerator is not None and choice != _accelerator and "deepspeed" in sys.modules:
        raise ConfigError(f"trainer.accelerator={choice} comes after DeepSpeed started on {_accelerator}")
    _accelerator = choice
    os.environ["DS_ACCELERATOR"] = choice
    deepspeed_globals.use_accelerator(choice)
    return choice


def cuda_available() -> bool:
    """True when this process trains on CUDA devices (see `select_accelerator`)."""
    return (_accelerator or select_accelerator()) == "cuda"


def configure_environment() -> None:
    """Set the environment DeepSpeed reads at import/first use. Importing `framework` calls it."""
    # Torch extensions (shm comm op) are never needed for gloo training; see init_process_group.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


_tf32_set = False


def use_tf32(enabled: bool = True) -> None:
    """TF32 matmuls and cuDNN convolutions on Ampere and newer GPUs (fp32 training at tensor-core
    speed, ~10 bits of mantissa in products); nothing on other devices."""
    global _tf32_set
    _tf32_set = True
    if cuda_available() and torch.cuda.get_device_capability(device())[0] >= 8:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def backend() -> str:
    """The collective backend: nccl on CUDA, gloo otherwise."""
    return "nccl" if cuda_available() else "gloo"


def launched() -> bool:
    """True when a launcher (torchrun, deepspeed, srun wrapper) already set the rank variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """Global rank (0 before the process group exists)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of processes in the job (1 before the process group exists)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_world_size() -> int:
    """Processes of this job on this machine, as the launcher set them (torchrun, submitit:
    LOCAL_WORLD_SIZE; DeepSpeed's launcher: LOCAL_SIZE); the whole world when none says."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return world_size()


def local_rank() -> int:
    """Rank of this process on its machine (as the launcher said, see `_share_device_index`)."""
    return int(_replaced_env.get("LOCAL_RANK", os.environ.get("LOCAL_RANK", 0)))


def is_main_process() -> bool:
    """True on global rank 0: the only rank that writes logs, metrics and summaries."""
    return rank() == 0


def device() -> torch.device:
    """The device this rank computes on: GPU LOCAL_RANK modulo the GPUs this process sees (one
    GPU per Slurm task sees only its own), the same index DeepSpeed is given (`device_index`)."""
    if cuda_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def device_index() -> int:
    """This rank's device index, as handed to DeepSpeed (`args.device_rank`)."""
    return device().index or 0


def _share_device_index() -> None:
    """DeepSpeed also reads LOCAL_RANK as a device index (init_process_group's device_id,
    zero.Init, pipeline and ZeRO helpers): a process that sees fewer GPUs than its local rank
    (one GPU per Slurm task) would make it name a device that does not exist ("invalid device
    ordinal"). DeepSpeed is told the index chosen here; the launcher's value comes back on teardown."""
    if cuda_available() and local_rank() != device_index():
        _replaced_env.setdefault("LOCAL_RANK", os.environ["LOCAL_RANK"])
        os.environ["LOCAL_RANK"] = str(device_index())


def collective_device() -> torch.device:
    """Where small tensors for collectives live: this rank's GPU under nccl, the CPU under gloo."""
    return device() if backend() == "nccl" else torch.device("cpu")


def local_device_count() -> int:
    """How many worker processes this machine can host usefully (GPUs, else CPU cores)."""
    if cuda_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def free_port() -> int:
    """A TCP port that was free a moment ago on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet_deepspeed(verbose: bool = False) -> None:
    """Hide DeepSpeed's INFO/WARNING chatter and torch.distributed's per-step deprecation warnings."""
    if verbose:
        return
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        from deepspeed.utils import set_log_level_from_string

        set_log_level_from_string("error")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"deepspeed.*")
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    # DeepSpeed's pipeline broadcasts tied weights through autograd; torch warns on every backward.
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")


def init_process_group(timeout_s: float = 300.0) -> None:
    """Join (or create) the process group for this job; a no-op if it already exists.

    A single process started without a launcher gets the five rendezvous variables
    DeepSpeed needs (else it tries MPI discovery), on a fresh free port.
    """
    global _we_initialized
    if dist.is_initialized():
        return
    if not launched():
        defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        defaults["MASTER_PORT"] = str(free_port())
        for key, value in defaults.items():
            if key not in os.environ:
                os.environ[key] = value
                _owned_env.append(key)
    if cuda_available():
        _share_device_index()
        torch.cuda.set_device(device())
        if not _tf32_set:
            use_tf32(True)
    tune_host_allocator(cuda_available())
    if not cuda_available() and "LOCAL_SIZE" not in os.environ:
        # DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE (its launcher sets it) and
        # otherwise runs `numactl` in a subprocess, which ZeRO-3 does for every gradient bucket.
        os.environ["LOCAL_SIZE"] = str(local_world_size())
        _owned_env.append("LOCAL_SIZE")
    import deepspeed
    import deepspeed.ops

    # The shared-memory comm op is only used by AutoTP inference; marking it incompatible avoids a
    # ~45 s JIT build. Setting the table directly also skips DeepSpeed's probe of every op
    # (compiler subprocesses on first access); the comm backend is its only reader.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    if not dist.is_initialized() and world_size() == 1:
        # One process talks to nobody: an in-memory store, no port that another program could hold.
        dist.init_process_group(
            backend(),
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(
            dist_backend=backend(),
            auto_mpi_discovery=False,
            verbose=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    _we_initialized = True
    if world_size() > 1:
        _slow()  # every rank makes it now, together (creating a group is collective)
        # Which process each rank is, so a watchdog can name (and end) a stopped peer on its host.
        watchdog.set_peers(all_gather_object((socket.gethostname(), os.getpid())))
    _tear_down_at_exit()


_exit_hook_installed = False
_failed = False


def _tear_down_at_exit() -> None:
    """A script that ends without destroying the group still exits cleanly (a 2-rank gloo exit
    without it can SIGABRT): the group is destroyed at interpreter exit, waiting for the other
    ranks only if this one did not die of an exception."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    previous = sys.excepthook

    def note_failure(*args: Any) -> None:
        global _failed
        _failed = True
        previous(*args)

    sys.excepthook = note_failure
    atexit.register(lambda: destroy_process_group(sync=not _failed))


def destroy_process_group(sync: bool = True, timeout_s: float = 30.0) -> None:
    """Tear down a group this module created (a 2-rank gloo exit without it can SIGABRT).

    `sync` (gloo): first wait, at most `timeout_s`, until every rank is here, so that no rank
    exits and drops connections another rank's gloo threads still use (that too can SIGABRT the
    slower rank). After a failure pass sync=False: the other ranks may sit in a collective, and
    waiting for them would only delay the exit.
    """
    global _we_initialized
    global _slow_group
    _slow_group = None
    if _we_initialized and dist.is_initialized():
        if sync and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            with contextlib.suppress(RuntimeError):  # a rank that never came: tear down anyway
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        dist.destroy_process_group()
        deepspeed_globals.forget_groups()
    _we_initialized = False
    while _owned_env:
        os.environ.pop(_owned_env.pop(), None)
    os.environ.update(_replaced_env)
    _replaced_env.clear()


# Waits on long work of one rank (rank 0 hashing, fsyncing, converting a large checkpoint) go
# through a gloo group without a practical timeout: under nccl the default group's watchdog would
# end the job while the other ranks wait, though nothing is stuck (the watchdog module covers that).
SLOW_WAIT = datetime.timedelta(hours=12)
_slow_group: Any = None


def _slow() -> Any:
    global _slow_group
    if _slow_group is None:
        _slow_group = dist.new_group(backend="gloo", timeout=SLOW_WAIT)
    return _slow_group


def barrier(slow: bool = False) -> None:
    """Wait until every rank is here (nothing without a group of more than one). `slow`: a wait
    on one rank's long work (see SLOW_WAIT)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=_slow() if slow else None)


def broadcast_object(obj: Any, src: int = 0, slow: bool = False) -> Any:
    """Rank `src`'s `obj` on every rank (identity without a group); `slow` as for `barrier`."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_slow() if slow else None)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_mean(value: float) -> float:
    """Mean of a Python float over ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's integer."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


@contextlib.contextmanager
def process_group(timeout_s: float = 300.0) -> Iterator[None]:
    """Scope a run's process-group lifecycle (one per Hydra job, so sweeps can run jobs back to back)."""
    init_process_group(timeout_s)
    try:
        yield
    except BaseException:
        destroy_process_group(sync=False)
        raise
    destroy_process_group()
