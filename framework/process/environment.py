"""What the launcher and the machine say, before a process context exists: whether a launcher
set the rank variables and which, a free port, and where this process can compute (the
accelerator choice, the devices it may use, TF32). Pure reads of the environment and of torch.
"""

from __future__ import annotations

import os
import socket
import sys

import torch

from framework.errors import ConfigError

ACCELERATORS = ("auto", "cpu", "cuda")


def launched() -> bool:
    """True when a launcher (torchrun, deepspeed, an srun step joined by `launch.join_slurm_tasks`)
    set the rank variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> int:
    """This process's global rank as its launcher set it (0 without one)."""
    return int(os.environ.get("RANK", 0))


def env_world_size() -> int:
    """The job's processes as its launcher set them (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def env_local_world_size() -> int:
    """Processes of this job on this machine, as the launcher set them (torchrun, submitit:
    LOCAL_WORLD_SIZE; DeepSpeed's launcher: LOCAL_SIZE); the whole world when none says."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return env_world_size()


def cores_per_rank() -> int:
    """The CPU cores this process has to itself: those it may run on, shared with the other ranks
    of its job on this machine (`env_local_world_size`); at least one."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, available // max(1, env_local_world_size()))


def free_port() -> int:
    """A TCP port that was free a moment ago on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gpu_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def choose_accelerator(choice: str = "auto") -> str:
    """Where this process computes: "cuda" or "cpu".

    auto: CUDA when torch sees a GPU, unless DS_ACCELERATOR=cpu says otherwise (a GPU this torch
    cannot use is said in one line); cpu: the CPU even on a GPU machine; cuda: CUDA, or a
    ConfigError when torch sees none."""
    if choice not in ACCELERATORS:
        raise ConfigError(f"trainer.accelerator={choice}: use auto, cpu or cuda")
    if choice == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(
            f"trainer.accelerator=cuda, but torch {torch.__version__} ({build}) sees no CUDA device; "
            "install a CUDA build of torch, check CUDA_VISIBLE_DEVICES, or use trainer.accelerator=cpu"
        )
    if choice != "auto":
        return choice
    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu":
        return "cuda"
    if not torch.cuda.is_available() and _gpu_present() and env_rank() == 0:
        print(
            f"accelerator: this machine has a GPU but torch {torch.__version__} cannot use it; training "
            "on the CPU (install a CUDA build of torch, or set trainer.accelerator=cpu to silence this)",
            file=sys.stderr,
        )
    return "cpu"


def local_device_count(accelerator: str) -> int:
    """How many worker processes this machine can host usefully (GPUs, else CPU cores)."""
    if accelerator == "cuda":
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def use_tf32(enabled: bool = True) -> None:
    """TF32 matmuls and cuDNN convolutions on Ampere and newer GPUs (fp32 training at tensor-core
    speed, ~10 bits of mantissa in products); nothing elsewhere."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def host_memory_bytes() -> int:
    """This machine's memory as this process may use it: the RAM, or the container's (cgroup)
    limit when that is lower."""
    total = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(limit_file).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def device_memory_bytes(accelerator: str, device_index: int = 0, local_ranks: int = 1) -> int:
    """One rank's memory: its GPU's total, or on a CPU the machine's memory over the ranks on it."""
    if accelerator == "cuda":
        return int(torch.cuda.get_device_properties(device_index).total_memory)
    return host_memory_bytes() // max(1, local_ranks)
