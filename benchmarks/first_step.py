"""Time to first step: `python train.py trainer.max_steps=1` against a hand-written DeepSpeed
script doing the same (benchmarks/raw_first_step.py), whole-process wall time, alternated.
Also the import time of each dependency that dominates start-up.

    python -m benchmarks.first_step [--quick | --smoke]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import median, parse_args, print_table, write

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = [
    "torch",
    "deepspeed",
    "hydra.utils",
    "torchmetrics",
    "sklearn.datasets",
    "torchdata.stateful_dataloader",
    "framework",
]


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("WANDB_MODE", "disabled")
    return env


def wall(cmd: list[str]) -> float:
    """Seconds a command takes from start to exit (it must succeed)."""
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {run.returncode}:\n{run.stderr[-3000:]}")
    return time.perf_counter() - start


def import_cost(module: str) -> float:
    """Seconds `import module` adds after `import torch` (torch itself: after nothing)."""
    pre = "" if module == "torch" else "import torch;"
    code = f"import time;{pre}t=time.perf_counter();import {module};print(time.perf_counter()-t)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Alternate the two commands and write results/first_step.json."""
    args = parse_args(__doc__, argv)
    repeats = 1 if args.smoke else 3 if args.quick else 5
    ours, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            raw.append(wall([sys.executable, str(ROOT / "benchmarks" / "raw_first_step.py")]))
            ours.append(
                wall(
                    [
                        sys.executable,
                        str(ROOT / "train.py"),
                        "trainer.max_steps=1",
                        "trainer.epochs=1",
                        f"hydra.run.dir={tmp}/{i}",
                    ]
                )
            )
    rows = [{"raw_s": median(raw), "train_py_s": median(ours), "ratio": median(ours) / median(raw)}]
    imports = [{"module": m, "import_s": import_cost(m)} for m in (IMPORTS[:2] if args.smoke else IMPORTS)]
    print_table("Time to first step (whole process)", rows)
    print_table("Import cost (after torch)", imports)
    write(
        "first_step",
        rows,
        {"target": "ratio <= 1.3", "imports": imports, "repeats": repeats},
        args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
