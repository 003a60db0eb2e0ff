"""A Hydra callback that keeps a summary of a sweep at its root: each job's overrides, status
(ok / preempted / requeued / failed), the step it reached and its monitored value, in
`summary.json` and as a table on the console.

It is rebuilt from the job dirs after every job (so a sweep that stops on a failed job still
has one) and once more at the end; jobs run by any launcher (basic, joblib, submitit) count.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig

STATUS_FILE = "status.json"
# What a job's status means in the summary (ok is the only one that finished).
STATUSES = {
    "ok": "finished",
    "preempted": "stopped by a preemption signal after saving a checkpoint; resume it",
    "requeued": "saved and handed back to Slurm, which runs it again from that checkpoint",
    "failed": "ended with an error (or was killed) before finishing",
}


def write_status(job_dir: Path, status: str) -> None:
    """Record how this job ended (rank 0, at its end): one of `STATUSES`."""
    if job_dir.is_dir():
        (job_dir / STATUS_FILE).write_text(json.dumps({"status": status}))


def clear_status(job_dir: Path) -> None:
    """Forget an earlier attempt's ending (a requeued or resumed job starts again)."""
    (job_dir / STATUS_FILE).unlink(missing_ok=True)


def _last_step(job_dir: Path, final: dict[str, Any] | None) -> int | None:
    """The optimizer step the job reached: its final metrics, else the last logged record."""
    if final is not None and "step" in final:
        return int(final["step"])
    step = None
    with contextlib.suppress(OSError):
        for line in (job_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError):
                step = int(json.loads(line).get("step", step))
    return step


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job dir under `sweep_dir`: job, overrides, status (see `STATUSES`), the step it
    reached, and its monitored value (that of the step reached when it did not finish)."""
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
        status_file = job_dir / STATUS_FILE
        status = json.loads(status_file.read_text()).get("status") if status_file.exists() else "failed"
        value = final.get(monitor) if final else None
        rows.append(
            {
                "job": str(job_dir.relative_to(sweep_dir)),
                "overrides": " ".join(overrides),
                "status": status if status in STATUSES else "failed",
                "step": _last_step(job_dir, final),
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
    for column in ("job", "overrides", "status", "step", "objective"):
        table.add_column(column, justify="right" if column in ("step", "objective") else "left")
    for row in rows:
        value = row["objective"]
        shown = f"{row['monitor']}={value:.4f}" if isinstance(value, (int, float)) else "-"
        step = "-" if row["step"] is None else str(row["step"])
        table.add_row(row["job"], row["overrides"], row["status"], step, shown)
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    unfinished = [row for row in rows if row["status"] != "ok"]
    if unfinished:
        console.print(
            f"{len(unfinished)} job(s) did not finish: "
            + "; ".join(
                f"{r['job']} ({r['overrides']}): {r['status']}"
                + (f" at step {r['step']}" if r["step"] else "")
                for r in unfinished
            )
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
        """Write and print the final summary; a sweep with a job that did not finish exits non-zero."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = write_summary(sweep_dir)
        print_summary(rows, sweep_dir)
        if any(row["status"] != "ok" for row in rows):
            raise SystemExit(1)
