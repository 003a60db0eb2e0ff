"""DeepSpeed's process-wide state, kept in step with the framework's `ProcessContext`: which
accelerator it computes on, its communication backend on the context's process group, the
process groups it caches in module globals (forgotten when the context closes), and its logging."""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import sys
import warnings
from typing import Any


def load() -> Any:
    """Import DeepSpeed (once) without the `mlflow` it would import: its autotuner module, imported
    with the package, tries `import mlflow` (~115 MB and ~3 s with SciPy, which mlflow imports) only
    to report its own trials. Blocked for the duration of that first import unless mlflow is already
    imported (`logger=mlflow` imports it itself, before or after, and gets the real module)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    block = "mlflow" not in sys.modules
    if block:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if block and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def join(ctx: Any) -> None:
    """Make DeepSpeed use the context's accelerator and process group (`ctx`: a started
    `framework.process.context.ProcessContext`); its cached groups go when the context closes.
    Groups DeepSpeed cached for a process group destroyed without a context's close (the user's
    `torch.distributed.destroy_process_group()`) are forgotten first."""
    if _stale_groups():
        forget_groups()
    use_accelerator(ctx.accelerator)
    load()
    import deepspeed
    import deepspeed.ops

    quiet_logging()  # DeepSpeed's logger comes back at INFO when it is first imported
    # The shared-memory comm op is only used by AutoTP inference; marking it incompatible avoids a
    # ~45 s JIT build. Setting the table directly also skips DeepSpeed's probe of every op
    # (compiler subprocesses on first access); the comm backend is its only reader.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    with contextlib.redirect_stdout(io.StringIO()):  # adopts the torch group the context made
        deepspeed.init_distributed(
            dist_backend=ctx.backend,
            auto_mpi_discovery=False,
            verbose=False,
            timeout=datetime.timedelta(seconds=ctx.timeout_s),
        )
    ctx.on_close(forget_groups)


def quiet(verbose: bool = False, accelerator: str | None = None) -> None:
    """Hide DeepSpeed's INFO/WARNING chatter and torch.distributed's per-step deprecation warnings
    (nothing when `verbose`). DeepSpeed is imported to set its logger, on `accelerator` when given
    (it fixes one when first imported, and says so at INFO)."""
    if verbose:
        return
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if accelerator is not None:
        use_accelerator(accelerator)
    quiet_logging()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"deepspeed.*")
    # DeepSpeed's pipeline broadcasts tied weights through autograd; torch warns on every backward.
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")


def quiet_logging() -> None:
    """DeepSpeed's own logger at ERROR."""
    with contextlib.suppress(Exception):
        load()
        from deepspeed.utils import set_log_level_from_string

        set_log_level_from_string("error")


def use_accelerator(choice: str) -> None:
    """Make an already imported DeepSpeed use `choice` ("cpu" or "cuda").

    DeepSpeed fixes its accelerator when it is first imported (from DS_ACCELERATOR, else CUDA when
    torch sees a GPU), and a run may import it (to quiet its logging) before it decides: on a GPU
    machine `trainer.accelerator=cpu` then put the weights on cuda:0 and the batches on the CPU.
    Not imported yet, it reads DS_ACCELERATOR when it is, which is set here."""
    if "deepspeed" not in sys.modules:
        os.environ["DS_ACCELERATOR"] = choice
        return
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() == choice:
        return
    if choice == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())


def _stale_groups() -> bool:
    """Whether a process group DeepSpeed cached is no longer registered with torch.distributed."""
    import torch.distributed as dist

    groups = sys.modules.get("deepspeed.utils.groups")
    for name, value in vars(groups).items() if groups is not None else ():
        if name.startswith("_") and name.isupper() and isinstance(value, dist.ProcessGroup):
            try:
                dist.get_process_group_ranks(value)
            except (ValueError, KeyError, RuntimeError):
                return True
    return False


def forget_groups() -> None:
    """DeepSpeed caches process groups in module globals; after the group is destroyed they are
    stale and the next job in this process (a Hydra sweep, a test) would fail on them."""
    with contextlib.suppress(ImportError):
        import deepspeed.comm as ds_comm
        from deepspeed.utils import groups

        ds_comm.cdb = None
        for name, value in list(vars(groups).items()):
            if not (name.startswith("_") and name.isupper() and "GROUP" in name):
                continue
            if isinstance(value, dict):
                value.clear()
            elif value is not None and not isinstance(value, (int, str)):
                setattr(groups, name, None)
