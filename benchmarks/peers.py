"""Peers: the same MLP and GPT tasks with PyTorch Lightning (its DDP strategy: its DeepSpeed
strategy refuses the CPU) and HF Accelerate, same data, global batch and steps, one process each
on this CPU. Reported: throughput ratio ours / theirs (target >= 1.0) and time to first step
(process start to the end of step 1). Peers come from the `bench` extra.

On a CPU the framework fixes glibc's allocator thresholds (`framework.process.allocator.tune_host_allocator`),
which alone speeds a small model's step by ~30%. So that the ratio shows more than that setting,
each peer also runs with the same thresholds, given through glibc's environment variables
(rows "<peer> + same allocator").

    python -m benchmarks.peers [--quick | --smoke]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import median, parse_args, print_table, write

ROOT = Path(__file__).resolve().parents[1]
PEERS = ["lightning", "accelerate"]


def same_allocator_env() -> dict[str, str]:
    """glibc's environment variables for the thresholds the framework sets on a CPU run."""
    from framework.process.allocator import HOST_MMAP_THRESHOLD, HOST_TRIM_THRESHOLD

    return {
        "MALLOC_MMAP_THRESHOLD_": str(HOST_MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(HOST_TRIM_THRESHOLD),
    }


def run(framework: str, task: str, steps: int, extra_env: dict[str, str] | None = None) -> dict[str, float]:
    """One framework on one task in a fresh process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"), BENCH_T0=repr(time.time()), PYTHONWARNINGS="ignore"
    )
    env.update(extra_env or {})
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_worker", framework, task, str(steps)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run each framework on each task (alternating, repeated) and write results/peers.json."""
    args = parse_args(__doc__, argv)
    peers = [p for p in PEERS if importlib.util.find_spec(p) is not None]
    tasks = ["mlp"] if args.smoke else ["mlp", "gpt"]
    steps, repeats = (6, 1) if args.smoke else (40, 2) if args.quick else (100, 3)
    rows = []
    for task in tasks:
        variants = {
            "hydraspeed": ("hydraspeed", None),
            "plain PyTorch loop + same allocator": ("plain", same_allocator_env()),
        }
        for peer in peers:
            variants[peer] = (peer, None)
            if not args.smoke:  # --smoke: the plain loop's row checks the allocator path
                variants[f"{peer} + same allocator"] = (peer, same_allocator_env())
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, (framework, extra_env) in variants.items():
                results[name].append(run(framework, task, steps, extra_env))
        ours = results["hydraspeed"]
        for name in results:
            rate = median([r["samples_per_s"] for r in results[name]])
            # the spread: ours / theirs in each repeat (the runs alternate, so each pair ran back to back)
            pairs = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(ours, results[name])]
            rows.append(
                {
                    "task": task,
                    "framework": name,
                    "samples_per_s": rate,
                    "ours_over_theirs": median([r["samples_per_s"] for r in ours]) / rate,
                    "spread": f"{min(pairs):.2f}-{max(pairs):.2f}",
                    "first_step_s": median([r["first_step_s"] for r in results[name]]),
                }
            )
    print_table("Throughput and time to first step, one process on this CPU", rows)
    write(
        "peers",
        rows,
        {
            "steps": steps,
            "repeats": repeats,
            "missing_peers": sorted(set(PEERS) - set(peers)),
            "target": "ours_over_theirs >= 1.0",
            "ours": "Engine.fit, ZeRO-0, fp32",
        },
        args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
