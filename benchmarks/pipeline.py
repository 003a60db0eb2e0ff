"""Pipeline bubble: the GPT in 2 stages (2 processes) against 1 stage (1 process), same global
batch and m micro-batches per step, m in {2, 4, 8}. With T1 the 1-stage step time and T2 the
2-stage one, the measured bubble is 1 - T1 / (2 T2) (the idle share of the two stages' time),
next to 1F1B's theory (p - 1) / (m + p - 1).

    python -m benchmarks.pipeline [--quick | --smoke]
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from benchmarks.common import StepTimes, median, parse_args, print_table, quiet, write


def worker(stages: int, micro_batches: int, micro: int, steps: int, n_layer: int) -> list[float]:
    """Train the GPT for `steps` steps; per-step times (rank 0)."""
    from framework import Engine, Strategy
    from framework.models import GPT, LMLoss

    quiet()
    torch.set_num_threads(1)  # one core per stage, and the 1-stage run on one core too
    if stages > 1:
        strategy = Strategy(pipeline={"stages": stages, "accumulate_steps": micro_batches})
    else:
        strategy = Strategy(gradient_merge={"k_steps": micro_batches})
    g = torch.Generator().manual_seed(0)
    n = micro * micro_batches * (steps + 2)
    ids = torch.randint(0, 128, (n, 65), generator=g)
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    torch.manual_seed(0)
    timer = StepTimes()
    model = GPT(n_layer=n_layer, n_embd=128, n_head=4)
    engine = Engine(
        model, LMLoss(), functools.partial(torch.optim.AdamW, lr=1e-3), strategy=strategy, callbacks=[timer]
    )
    engine.fit(
        data, epochs=1, batch_size=micro * micro_batches, max_steps=steps, log_freq=10**9, progress=False
    )
    engine.close()
    return timer.times


def measure(micro_batches: int, micro: int, steps: int, n_layer: int) -> dict[str, Any]:
    """T1 (one process, no pipeline) and T2 (two stages) at the same global batch."""
    from framework.process.launch import spawn

    one = median(spawn(worker, (1, micro_batches, micro, steps, n_layer), 1)[1:])
    two = median(spawn(worker, (2, micro_batches, micro, steps, n_layer), 2)[1:])
    p, m = 2, micro_batches
    return {
        "micro_batches": m,
        "t1_ms": one * 1000,
        "t2_ms": two * 1000,
        "speedup": one / two,
        "bubble_measured": 1 - one / (p * two),
        "bubble_1f1b_theory": (p - 1) / (m + p - 1),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run m in {2, 4, 8} and write results/pipeline.json."""
    args = parse_args(__doc__, argv)
    grid = [2] if args.smoke else [2, 4, 8]
    steps = 3 if args.smoke else 6 if args.quick else 12
    rows = [measure(m, micro=8, steps=steps, n_layer=2 if args.smoke else 6) for m in grid]
    print_table("Pipeline bubble, GPT, 2 stages vs 1 (same global batch)", rows)
    write(
        "pipeline",
        rows,
        {"stages": 2, "micro_batch": 8, "model": "GPT n_embd=128, 6 layers", "threads_per_process": 1},
        args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
