"""DeepSpeed's process-wide state, kept in step with the framework's (`framework.process.context` calls
these): which accelerator it computes on, and the process groups it caches in module globals."""

from __future__ import annotations

import contextlib
import sys


def use_accelerator(choice: str) -> None:
    """Make an already imported DeepSpeed use `choice` ("cpu" or "cuda").

    DeepSpeed fixes its accelerator when it is first imported (from DS_ACCELERATOR, else CUDA when
    torch sees a GPU), and a run may import it (to quiet its logging) before it decides: on a GPU
    machine `trainer.accelerator=cpu` then put the weights on cuda:0 and the batches on the CPU.
    Not imported yet, it reads DS_ACCELERATOR, which the caller sets."""
    if "deepspeed" not in sys.modules:
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
