"""Overhead of `Engine.fit` over a minimal hand-written DeepSpeed loop.

Same model, data and DeepSpeed config; in one process tree the two loops take turns
(A, B, A, B, ...) so the machine's noise hits both alike, under the same allocator thresholds. Reported: median per-step time of
each and the ratio fit / raw (target <= 1.03), for ZeRO-0 and ZeRO-3 on 1 and 2 processes.

    python -m benchmarks.overhead [--quick | --smoke]
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Any

import torch

from benchmarks.common import StepTimes, median, parse_args, print_table, quiet, start_job, write


def worker(stage: int, steps: int, rounds: int, hidden: int, batch: int) -> dict[str, Any]:
    """On every rank: raw DeepSpeed and Engine.fit, alternating; per-step times of rank 0."""
    import deepspeed

    from framework import Engine, Strategy
    from framework.backend.ds_config import deepspeed_config
    from framework.data.loaders import train_loader
    from framework.models import MLP
    from framework.plan.cost import param_counts
    from framework.plan.run_plan import batch_layout
    from framework.process.allocator import tune_host_allocator

    quiet()
    job = start_job()
    # both loops under the allocator thresholds the framework sets (process-wide, so otherwise the
    # raw loop's first round would run with glibc's defaults and the rest with the framework's)
    tune_host_allocator(sharded=stage > 0)
    strategy = Strategy(sharding={"stage": stage})
    world = job.world_size
    layout = batch_layout(strategy, batch, world)
    g = torch.Generator().manual_seed(0)
    n = batch * (steps + 1) * rounds * 2
    data = torch.utils.data.TensorDataset(
        torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    torch.manual_seed(0)
    model_a = MLP(256, [hidden, hidden], 10)
    model_b = copy.deepcopy(model_a)
    numel, largest = param_counts(model_a)
    config = deepspeed_config(strategy, layout, numel, largest)
    loss_fn = torch.nn.CrossEntropyLoss()
    raw, _, _, _ = deepspeed.initialize(
        model=model_a, optimizer=torch.optim.AdamW(model_a.parameters(), lr=1e-3), config=config
    )
    loader = train_loader(data, layout.micro_batch_size, world, job.rank, seed=0)
    timer = StepTimes()
    engine = Engine(
        model_b,
        loss_fn,
        functools.partial(torch.optim.AdamW, lr=1e-3),
        strategy=strategy,
        callbacks=[timer],
        process=job,
    )
    raw_times: list[float] = []
    batches = iter(loader)
    for _ in range(rounds):
        last = None
        for _ in range(steps + 1):  # A: the hand-written loop
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            loss = loss_fn(raw(x), y)
            raw.backward(loss)
            raw.step()
            loss.item()  # as a training loop that logs would
            now = time.perf_counter()
            if last is not None:
                raw_times.append(now - last)
            last = now
        target = engine.state.global_step + steps + 1  # B: Engine.fit for as many steps
        engine.fit(data, epochs=10**6, batch_size=batch, max_steps=target, log_freq=10**9, progress=False)
    job.close()
    return {"raw": raw_times, "fit": timer.times}


def measure(stage: int, nproc: int, steps: int, rounds: int, hidden: int, batch: int) -> dict[str, Any]:
    """One configuration: in this process (1) or in nproc workers (framework.process.launch.spawn)."""
    if nproc == 1:
        times = worker(stage, steps, rounds, hidden, batch)
    else:
        from framework.process.launch import spawn

        times = spawn(worker, (stage, steps, rounds, hidden, batch), nproc)
    raw, fit = median(times["raw"]), median(times["fit"])
    return {
        "zero_stage": stage,
        "processes": nproc,
        "raw_ms": raw * 1000,
        "fit_ms": fit * 1000,
        "ratio_fit_over_raw": fit / raw,
        "steps_each": len(times["fit"]),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid and write results/overhead.json."""
    args = parse_args(__doc__, argv)
    steps, rounds, hidden = (3, 2, 64) if args.smoke else (10, 4, 1024) if args.quick else (20, 6, 1024)
    rows = []
    for nproc in (1,) if args.smoke else (1, 2):
        for stage in (0, 3):
            rows.append(measure(stage, nproc, steps, rounds, hidden, batch=64))
    print_table("Engine.fit vs a hand-written DeepSpeed loop (median ms per step)", rows)

    write(
        "overhead",
        rows,
        {"model": f"MLP 256-{hidden}-{hidden}-10", "global_batch": 64, "target": "ratio <= 1.03"},
        args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
