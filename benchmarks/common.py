"""What every benchmark shares: where results go, the machine they ran on, a printed table."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

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
    from framework import device

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device.quiet_deepspeed()
