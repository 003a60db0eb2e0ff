"""What every benchmark shares: where results go, the machine they ran on, a printed table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from framework.observe.callbacks import Callback

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The machine and versions a result was measured on."""
    import deepspeed
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def write(
    name: str, rows: list[dict[str, Any]], notes: dict[str, Any] | None = None, out_dir: Path | None = None
) -> Path:
    """Write `results/<name>.json` (rows, machine, notes) and return its path."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(
        json.dumps({"benchmark": name, "machine": machine(), "notes": notes or {}, "rows": rows}, indent=2)
    )
    return path


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Rows as a table on the console."""
    from rich.console import Console
    from rich.table import Table

    if not rows:
        return
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(str(key), justify="right")
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    Console(highlight=False, width=200).print(table)


def median(values: list[float]) -> float:
    """Median of a non-empty list."""
    return float(statistics.median(values))


def quiet() -> None:
    """The same quiet environment the framework sets up for a run."""
    from framework.backend import deepspeed_globals
    from framework.process.context import choose_accelerator

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    deepspeed_globals.quiet(accelerator=choose_accelerator())


def start_job() -> Any:
    """This process's `ProcessContext` with DeepSpeed joined to its group, as a run has it (for a
    hand-written DeepSpeed loop beside Engine.fit)."""
    from framework import ProcessContext
    from framework.backend import deepspeed_globals

    job = ProcessContext.start()
    deepspeed_globals.join(job)
    return job


def end_job() -> None:
    """End this process's process group, whichever context made it, with DeepSpeed's cached
    groups (between the rows or checks of one benchmark process)."""
    import torch.distributed as dist

    from framework.backend import deepspeed_globals

    if dist.is_initialized():
        dist.destroy_process_group()
    deepspeed_globals.forget_groups()


def parse_args(doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The flags every benchmark takes: --quick, --smoke (smallest sizes, for the tests), --out-dir."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="shorter runs (python -m benchmarks.run --quick)"
    )
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes: checks the script runs")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where to write the JSON (default benchmarks/results)"
    )
    return parser.parse_args(argv)


class StepTimes(Callback):
    """Seconds between consecutive optimizer steps as the training loop reports them; the first
    interval of each fit call (which includes starting the loader) is dropped."""

    stops_alike = True  # a timer never stops training: no per-step stop agreement for it

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last: float | None = None
        self.step = -1

    def on_fit_start(self, state: Any) -> None:
        """A new fit call."""
        self.last = None

    def on_step_end(self, state: Any) -> None:
        """Record the interval when an optimizer step was taken (not at every micro-batch)."""
        if state.global_step == self.step:
            return
        self.step = state.global_step
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now
