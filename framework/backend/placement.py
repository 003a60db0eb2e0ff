"""Where a strategy's states live on this machine.

Without an accelerator there is nowhere to offload to: offload is dropped (said once). With a
GPU, an offloaded optimizer steps with DeepSpeed's CPU Adam when it can be built.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.plan.strategy import Strategy
from framework.process.context import ProcessContext
from framework.process.environment import env_rank


def for_this_machine(strategy: Strategy, cuda: bool) -> Strategy:
    """`strategy` as it will run here (`cuda`: on GPUs): without an accelerator, offload is
    dropped (see `Strategy.for_host_only`) and rank 0 says so in one line."""
    if cuda:
        return strategy
    host = strategy.for_host_only()
    if host is not strategy and env_rank() == 0:
        print(
            "strategy: no accelerator, so offload has nowhere to move states to; "
            f"running {host.describe()} (states stay in host memory)",
            flush=True,
        )
    return host


def offload_optimizer(strategy: Strategy, optimizer: Any, process: ProcessContext) -> Any:
    """Under optimizer offload on a GPU machine, a torch Adam/AdamW factory becomes DeepSpeed's CPU
    Adam (vectorised; torch's steps the offloaded fp32 states several times slower) when it can
    be built (ninja and a C++ compiler); otherwise the torch optimizer stays, said in one line."""
    import functools
    import shutil

    target = optimizer.func if isinstance(optimizer, functools.partial) else None
    if not (
        strategy.sharding.offload_optimizer
        and process.cuda
        and target in (torch.optim.Adam, torch.optim.AdamW)
    ):
        return optimizer
    problem = _cpu_adam_problem() if shutil.which("ninja") else "ninja is not installed"
    if problem:
        if process.is_main:
            print(
                f"offload: DeepSpeed's CPU Adam cannot be built here ({problem}); the offloaded "
                f"optimizer steps with torch's {target.__name__} on the CPU, which is slower",
                flush=True,
            )
        return optimizer
    import inspect

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = {k: p.default for k, p in inspect.signature(target).parameters.items()}
    given = {**defaults, **optimizer.keywords}  # type: ignore[union-attr]
    kwargs = {k: given[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad") if k in given}
    return lambda params: DeepSpeedCPUAdam(params, adamw_mode=target is torch.optim.AdamW, **kwargs)


def _cpu_adam_problem() -> str | None:
    """Why DeepSpeed's CPU Adam op cannot be loaded (built on first use: ~1 min), or None."""
    from framework.process import watchdog

    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        with watchdog.suspended():
            CPUAdamBuilder().load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, a failed build, ...: torch's optimizer then
        lines = str(exc).strip().splitlines()
        return lines[0] if lines else type(exc).__name__
    return None
