"""Data stalls hidden by prefetching.

A loader needs D ms per batch (its collate sleeps) and a step needs about C ms (it sleeps C,
then a tiny forward/backward). A naive loop pays C + D per step; the framework's prefetcher
should pay about max(C, D). Reported per (C, D): step time / max(C, D) for Engine.fit (target
<= 1.10) next to the naive loop's.

    python -m benchmarks.stalls [--quick | --smoke]
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from benchmarks.common import StepTimes, median, parse_args, print_table, quiet, write


def sleepy_collate(batch: list[Any], delay: float) -> Any:
    """Collate after `delay` seconds: a loader that needs D ms per batch (decoding, augmenting, I/O)."""
    time.sleep(delay)
    return default_collate(batch)


def _naive(data: Any, collate: Any, c: float) -> list[float]:
    from framework.models import MLP

    model = MLP(hidden=[16])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, last = [], None
    for x, y in DataLoader(data, batch_size=16, collate_fn=collate):
        time.sleep(c)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times


def _fit(data: Any, collate: Any, c: float) -> list[float]:
    from framework import Engine
    from framework.engine.steps import default_train_step
    from framework.models import MLP

    def step(engine: Engine, batch: Any) -> torch.Tensor:
        time.sleep(c)
        return default_train_step(engine, batch)

    timer = StepTimes()
    engine = Engine(
        MLP(hidden=[16]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.01),
        train_step=step, callbacks=[timer],
    )  # fmt: skip
    engine.fit(
        data, epochs=1, batch_size=16, collate_fn=collate, shuffle=False, log_freq=10**9, progress=False
    )
    engine.close()
    return timer.times


def run_pair(compute_ms: float, data_ms: float, steps: int) -> dict[str, Any]:
    """Naive loop and Engine.fit on the same loader cost and step cost. The step's real cost C
    (the sleep plus its own forward/backward and bookkeeping) is measured with an instant loader,
    for each loop, so the ratios compare against max(C, D) as it really is."""
    c, d = compute_ms / 1000, data_ms / 1000
    n = 16 * (steps + 2)
    data = TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
    instant = functools.partial(sleepy_collate, delay=0.0)
    slow = functools.partial(sleepy_collate, delay=d)
    naive_c, fit_c = median(_naive(data, instant, c)), median(_fit(data, instant, c))
    naive, fit = median(_naive(data, slow, c)), median(_fit(data, slow, c))
    return {
        "compute_ms": compute_ms,
        "data_ms": data_ms,
        "step_ms_naive": naive_c * 1000,
        "step_ms_fit": fit_c * 1000,
        "naive_over_max": naive / max(naive_c, d),
        "fit_over_max": fit / max(fit_c, d),
        "naive_ideal": (naive_c + d) / max(naive_c, d),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the (C, D) grid and write results/stalls.json."""
    args = parse_args(__doc__, argv)
    quiet()
    pairs = [(10, 10)] if args.smoke else [(20, 5), (20, 10), (20, 20), (10, 20), (5, 20)]
    steps = 5 if args.smoke else 30 if args.quick else 60
    rows = [run_pair(c, d, steps) for c, d in pairs]
    print_table("Step time / max(C, D): naive loop vs Engine.fit with prefetch", rows)
    write(
        "stalls",
        rows,
        {"target": "fit_over_max <= 1.10", "prefetch": 2},
        args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
