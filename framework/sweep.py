"""A Hydra callback that keeps a summary of a sweep at its root: each job's overrides, status
and monitored value, in `summary.json` and as a table on the console.

It is rebuilt from the job dirs after every job (so a sweep that stops on a failed job still
has one) and once more at the end; jobs run by any launcher (basic, joblib, submitit) count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job dir under `sweep_dir`: job, overrides, status (ok / failed), objective."""
    rows = []
    job_dirs = [p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")]
    for job_dir in sorted(job_dirs, key=lambda p: (len(p.parts), str(p))):
        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
        config_file = job_dir / "config.yaml"
        monitor = "val_loss"
        if config_file.exists():
            config = yaml.safe_load(config_file.read_text()) or {}
            monitor = config.get("trainer", {}).get("monitor", monitor)
        final_file = job_dir / "final_metrics.json"
        final = json.loads(final_file.read_text()) if final_file.exists() else None
        value = final.get(monitor) if final else None
        rows.append(
            {
                "job": str(job_dir.relative_to(sweep_dir)),
                "overrides": " ".join(overrides),
                "status": "ok" if final is not None else "failed",
                "monitor": monitor,
                "objective": value if value is None or math.isfinite(value) else None,
            }
        )
    return rows


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Write `summary.json` at the sweep root and return its rows."""
    rows = collect(sweep_dir)
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    return rows


def print_summary(rows: list[dict[str, Any]], sweep_dir: Path) -> None:
    """The sweep as a table: overrides -> objective, failed jobs named."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sweep summary ({sweep_dir})")
    for column in ("job", "overrides", "status", "objective"):
        table.add_column(column, justify="right" if column == "objective" else "left")
    for row in rows:
        value = row["objective"]
        shown = f"{row['monitor']}={value:.4f}" if isinstance(value, (int, float)) else "-"
        table.add_row(row["job"], row["overrides"], row["status"], shown)
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    failed = [row for row in rows if row["status"] != "ok"]
    if failed:
        console.print(
            f"{len(failed)} job(s) failed: " + "; ".join(f"{r['job']} ({r['overrides']})" for r in failed)
        )


class SweepSummary(HydraCallback):
    """Registered in conf/train.yaml under hydra.callbacks."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Refresh the summary after each job of a multirun."""
        if config.hydra.mode is not None and str(config.hydra.mode).endswith("MULTIRUN"):
            sweep_dir = Path(config.hydra.sweep.dir)
            if sweep_dir.is_dir():
                write_summary(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write and print the final summary; a sweep with a failed job exits non-zero."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = write_summary(sweep_dir)
        print_summary(rows, sweep_dir)
        if any(row["status"] != "ok" for row in rows):
            raise SystemExit(1)
