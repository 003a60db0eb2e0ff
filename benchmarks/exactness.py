"""What each guarantee costs: `Engine.fit` with one mechanism on against the same fit without it.

    item count             the global item count of every optimizer step (layout invariance:
                           framework.engine.items), against a loss that averages over samples
    preemption agreement   every rank agreeing each step whether a preemption signal came
                           (checkpoint.preemption.Agreement), against handle_preemption=False
    prefetch thread        batches pulled ahead by a background thread, against prefetch=0
    watchdog               the stuck-rank watchdog (timeout_s=300), against timeout_s=None
    throughput meter       samples/s, MFU and the step's phase times, against a fit without them

Per mechanism, two engines with the same model and data take turns (A, B, A, B, ...) in one
process tree, so the machine's noise hits both alike; reported: the median step time of each
and their ratio (with / without), on 1 and 2 processes, and the CPU time rank 0's process spent
per step (all its threads: the step, the prefetch thread, gloo's) beside the wall time, which
shows what a mechanism costs in work and what in waiting. MLP 256-1024-1024-10, global batch 64,
ZeRO-0, the framework's allocator thresholds. Where the framework leaves a mechanism out (no
item count for one micro-batch on one rank, no prefetch thread without a free core), both sides
run the same: the ratio is the noise floor.

    python -m benchmarks.exactness [--quick | --smoke]
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.common import StepTimes, median, parse_args, print_table, quiet, start_job, write

MECHANISMS = ("item count", "preemption agreement", "prefetch thread", "watchdog", "throughput meter")


def sample_mean_cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy without `ignore_index`: a loss that averages over samples, so no item count."""
    return torch.nn.functional.cross_entropy(outputs, labels)


@contextlib.contextmanager
def without_meter(on: bool) -> Iterator[None]:
    """While not `on`: fit's epochs run without the throughput meter (no phase timer either)."""
    from framework.engine import loops

    if on:
        yield
        return
    original = loops.train_epoch

    def epoch(host: Any, *args: Any) -> Any:
        host.runtime.timer = None
        return original(host, *args[:-1], None)

    loops.train_epoch = epoch  # type: ignore[assignment]
    try:
        yield
    finally:
        loops.train_epoch = original  # type: ignore[assignment]


class CpuStepTimes(StepTimes):
    """`StepTimes`, and this process's CPU seconds over the same intervals (every thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: list[float] = []
        self.last_cpu = 0.0

    def on_step_end(self, state: Any) -> None:
        """Record wall and CPU time when an optimizer step was taken."""
        if state.global_step == self.step:
            return
        now = time.process_time()
        if self.last is not None:
            self.cpu.append(now - self.last_cpu)
        self.last_cpu = now
        super().on_step_end(state)


def _pair(
    mechanism: str, job: Any, hidden: int, save_dir: str
) -> list[tuple[Any, dict[str, Any], CpuStepTimes]]:
    """(engine, fit options, step timer) with the mechanism on, then off."""
    from framework import Engine, Strategy
    from framework.models import MLP

    out = []
    for on in (True, False):
        torch.manual_seed(0)
        timer = CpuStepTimes()
        loss = torch.nn.CrossEntropyLoss() if on or mechanism != "item count" else sample_mean_cross_entropy
        prefetch = 2 if on or mechanism != "prefetch thread" else 0
        engine = Engine(
            MLP(256, [hidden, hidden], 10), loss, functools.partial(torch.optim.AdamW, lr=1e-3),
            strategy=Strategy(), callbacks=[timer], process=job, prefetch=prefetch,
        )  # fmt: skip
        options: dict[str, Any] = {"timeout_s": 300.0 if on or mechanism != "watchdog" else None}
        if mechanism == "preemption agreement":
            options.update(save_dir=f"{save_dir}/{int(on)}", save_freq=0, handle_preemption=on, keep_last_k=1)
        out.append((engine, options, timer))
    return out


def worker(steps: int, rounds: int, hidden: int, batch: int) -> dict[str, Any]:
    """On every rank: each mechanism's two fits, alternating; rank 0's step times."""
    from framework.process.allocator import tune_host_allocator

    quiet()
    job = start_job()
    tune_host_allocator(sharded=False)
    g = torch.Generator().manual_seed(0)
    n = batch * (steps + 1) * rounds * 2
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    times: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="exactness-") as save_dir:
        save_dir = job.broadcast_object(save_dir)
        for mechanism in MECHANISMS:
            pair = _pair(mechanism, job, hidden, save_dir)
            for _ in range(rounds):
                for (engine, options, _), on in zip(pair, (True, False)):
                    target = engine.state.global_step + steps + 1
                    with without_meter(on or mechanism != "throughput meter"):
                        engine.fit(
                            data, epochs=10**6, batch_size=batch, max_steps=target, log_freq=10**9,
                            progress=False, **options,
                        )  # fmt: skip
            times[mechanism] = [(timer.times, timer.cpu) for _, _, timer in pair]
            job.barrier()
    job.close()
    return times


def measure(nproc: int, steps: int, rounds: int, hidden: int, batch: int) -> list[dict[str, Any]]:
    """Every mechanism on `nproc` processes: in this process (1) or in nproc workers."""
    if nproc == 1:
        times = worker(steps, rounds, hidden, batch)
    else:
        from framework.process.launch import spawn

        times = spawn(worker, (steps, rounds, hidden, batch), nproc)
    rows = []
    for mechanism in MECHANISMS:
        (with_it, with_cpu), (without, without_cpu) = ((median(w), median(c)) for w, c in times[mechanism])
        rows.append(
            {
                "mechanism": mechanism,
                "processes": nproc,
                "with_ms": with_it * 1000,
                "without_ms": without * 1000,
                "ratio_with_over_without": with_it / without,
                "with_cpu_ms": with_cpu * 1000,
                "without_cpu_ms": without_cpu * 1000,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run both process counts and write results/exactness.json."""
    args = parse_args(__doc__, argv)
    steps, rounds, hidden = (3, 2, 64) if args.smoke else (10, 10, 1024) if args.quick else (20, 12, 1024)
    rows = []
    for nproc in (1,) if args.smoke else (1, 2):
        rows += measure(nproc, steps, rounds, hidden, batch=64)
    print_table("What each guarantee costs: Engine.fit with / without it (median ms per step)", rows)
    write(
        "exactness",
        rows,
        {
            "model": f"MLP 256-{hidden}-{hidden}-10",
            "global_batch": 64,
            "zero_stage": 0,
            "target": "ratio <= 1.03",
        },
        args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
