"""Where a run's numbers go: the console (rich progress / plain lines), `metrics.jsonl`, wandb.

Loggers are callbacks; the CLI creates them on rank 0 only, so other ranks write nothing.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from framework.observe.callbacks import Callback
from framework.observe.state import LoopState


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def _rates(logs: dict[str, Any]) -> str:
    """ " 51,200 tokens/s MFU 41.2% (data 1.2 forward 20.1 backward 40.3 optimizer 5.0 ms)" from a step's logs."""
    text = f" {logs['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in logs else ""
    if "mfu" in logs:
        text += f" MFU {100 * logs['mfu']:.1f}%"
    phases = [(k[5:-3], v) for k, v in logs.items() if k.startswith("time_") and k.endswith("_ms")]
    if phases:
        text += " (" + " ".join(f"{name} {ms:.1f}" for name, ms in phases) + " ms)"
    return text


def _throughput_summary(rates: dict[str, list[float]], state: LoopState) -> str:
    """The run's mean throughput and MFU, and what the MFU is relative to."""

    def mean(key: str) -> float:
        return sum(rates[key]) / len(rates[key])

    text = f"throughput: {mean('samples_per_s'):,.0f} samples/s"
    if rates.get("tokens_per_s"):
        text += f", {mean('tokens_per_s'):,.0f} tokens/s"
    info = state.info
    if rates.get("mfu") and info.peak_flops and info.flops_per_step:
        text += (
            f", MFU {100 * mean('mfu'):.1f}% of {info.peak_flops / 1e12:,.2f} TFLOP/s per device "
            f"({info.flops_per_step / 1e9:,.2f} GFLOP per step and rank; {info.flops_source})"
        )
    elif info.flops_per_step and not info.peak_flops and info.device_type != "cpu":
        text += ", MFU with trainer.peak_tflops (no known peak for this device)"  # an accelerator we lack a table for
    return text + " (mean over logging points)"


def _trainable(info: Any) -> str:
    """', 36,992 trainable' when fewer parameters train than the model has (an adapter run)."""
    count = info.trainable_parameters
    return f", {count:,} trainable" if 0 < count < info.parameters else ""


class ConsoleLogger(Callback):
    """A live progress bar per epoch on a terminal (loss, lr, samples/s, ETA); plain periodic lines
    when stdout is not a terminal (CI, Slurm logs); a summary table at the end."""

    stops_alike = True  # never stops training between steps

    rank_zero_only = True

    def __init__(self, output_dir: str | None = None, force_terminal: bool | None = None):
        from rich.console import Console

        self.console = Console(force_terminal=force_terminal, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal and not os.environ.get("CI")
        self.output_dir = output_dir
        self.progress: Any = None
        self.task: Any = None
        self._t0 = self._window_t = time.perf_counter()
        self._window_samples = 0
        self._loss: float | None = None
        self.best: dict[str, float] = {}
        self.rates: dict[str, list[float]] = {}  # throughput at each logging point

    def on_fit_start(self, state: LoopState) -> None:
        """Print what is about to run."""
        info = state.info
        self._t0 = time.perf_counter()
        self.console.print(
            f"[bold]{info.model_name}[/bold] ({info.parameters:,} parameters{_trainable(info)}) | {info.strategy} | "
            f"{info.world_size} process(es) on {info.device_type} | global batch {state.global_batch_size} | "
            + (
                f"{state.epochs} epoch(s) of {state.batches_per_epoch} batches per rank"
                if state.batches_per_epoch
                else f"a stream, up to {state.max_steps} optimizer steps"
            )
        )
        for note in info.notes:
            self.console.print(f"note: {note}", markup=False, highlight=False)

    def on_epoch_start(self, state: LoopState) -> None:
        """Open this epoch's progress bar."""
        self._window_t, self._window_samples = time.perf_counter(), state.samples_seen
        if not self.live:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn(f"epoch {state.epoch + 1}/{state.epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[speed]} samples/s"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            "train", total=state.batches_per_epoch, loss="-", lr="-", speed="-"
        )

    def _speed(self, state: LoopState) -> float:
        now = time.perf_counter()
        speed = (state.samples_seen - self._window_samples) / max(now - self._window_t, 1e-9)
        return speed

    def on_step_end(self, state: LoopState) -> None:
        """Advance the bar (every step) or print a line (at logging points without a terminal)."""
        if "loss" in state.logs:
            self._loss = state.logs["loss"]
        if state.log_now:
            for key in ("samples_per_s", "tokens_per_s", "mfu"):
                if key in state.logs:
                    self.rates.setdefault(key, []).append(float(state.logs[key]))
        if self.live and self.progress is not None:
            self.progress.update(
                self.task,
                completed=state.batches_in_epoch,
                loss=_fmt(self._loss) if self._loss is not None else "-",
                lr=f"{state.logs.get('lr', 0.0):.2e}",
                speed=f"{self._speed(state):,.0f}",
            )
        elif state.log_now:
            total = f"/{state.batches_per_epoch}" if state.batches_per_epoch else ""
            self.console.print(
                f"epoch {state.epoch + 1}/{state.epochs} step {state.global_step} batch {state.batches_in_epoch}{total} "
                f"loss {_fmt(self._loss)} lr {state.logs.get('lr', 0.0):.2e} {self._speed(state):,.0f} samples/s"
                + _rates(state.logs)
            )
            self._window_t, self._window_samples = time.perf_counter(), state.samples_seen

    def on_validation_end(self, state: LoopState) -> None:
        """The validation before training starts gets a line of its own."""
        if state.global_step == 0:
            text = "  ".join(f"{k} {_fmt(v)}" for k, v in state.logs.items())
            self.console.print(f"before training: {text}")

    def on_epoch_end(self, state: LoopState) -> None:
        """One line per epoch with its training and validation numbers."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        shown = {k: v for k, v in state.logs.items() if k not in ("epoch", "batches")}
        for key, value in shown.items():
            if isinstance(value, (int, float)) and math.isfinite(value) and key != "lr":
                lower_is_better = "loss" in key
                best = self.best.get(key)
                if best is None or (value < best if lower_is_better else value > best):
                    self.best[key] = float(value)
        text = "  ".join(f"{k} {_fmt(v)}" for k, v in shown.items())
        self.console.print(
            f"epoch {state.epoch + 1}/{state.epochs}  step {state.global_step}  {text}  ({state.elapsed_s:.1f} s)"
        )

    def on_fit_end(self, state: LoopState) -> None:
        """A summary table: final and best value of each metric, time, where outputs are."""
        from rich.table import Table

        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        final = {k: v[-1] for k, v in state.history.items() if v}
        table = Table(title="hydraspeed run summary", show_lines=False)
        table.add_column("metric")
        table.add_column("final", justify="right")
        table.add_column("best", justify="right")
        for key, value in final.items():
            table.add_row(key, _fmt(value), _fmt(self.best[key]) if key in self.best else "")
        self.console.print(table)
        where = f"; outputs in {self.output_dir}" if self.output_dir else ""
        reason = f" ({state.stop_reason})" if state.stop_reason else ""
        self.console.print(
            f"done: {state.global_step} optimizer steps, {state.batches_fetched} batches, {state.samples_seen:,} samples "
            f"in {time.perf_counter() - self._t0:.1f} s{reason}{where}"
        )
        if self.rates.get("samples_per_s"):
            self.console.print(_throughput_summary(self.rates, state))


class MetricsFile(Callback):
    """One JSON object per logging step and per epoch in `metrics.jsonl` (flushed each line, so a
    crash loses nothing that was logged). A run resumed from a checkpoint keeps the records up
    to that checkpoint's step and continues the file, so it reads as one uninterrupted run."""

    stops_alike = True  # never stops training between steps

    rank_zero_only = True

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self._state: Any = None

    def on_fit_start(self, state: LoopState) -> None:
        """Open the file: fresh, or cut back to the resumed step."""
        resumed = state.info.resumed_from is not None
        if resumed and self.path.exists():  # keep what was logged up to the checkpoint, drop the rest
            kept = self.path.read_text().splitlines()[: state.records_written]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a" if resumed else "w", encoding="utf-8")  # noqa: SIM115 - closed on fit end
        self._state = state

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()
        self._state.records_written += 1

    def on_step_end(self, state: LoopState) -> None:
        """A record at each logging point."""
        if state.log_now:
            self._write(
                {
                    "kind": "step",
                    "step": state.global_step,
                    "epoch": state.epoch,
                    "batches": state.batches_in_epoch,
                    "batches_total": state.batches_fetched,
                    "samples": state.samples_seen,
                    **{k: v for k, v in state.logs.items() if k != "batches"},
                }
            )

    def on_validation_end(self, state: LoopState) -> None:
        """A record for the validation before training starts."""
        if state.global_step == 0:
            self._write({"kind": "validation", "step": 0, "batches_total": 0, **state.logs})

    def on_epoch_end(self, state: LoopState) -> None:
        """A record with the epoch's summary (and validation)."""
        self._write(
            {"kind": "epoch", "step": state.global_step, "batches_total": state.batches_fetched, **state.logs}
        )

    def on_fit_end(self, state: LoopState) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()


class WandbLogger(Callback):
    """Log to Weights & Biases from rank 0. Without an API key it runs offline and says how to sync;
    `WANDB_MODE=disabled` is respected; a server that cannot be reached never stops training.

    The CLI fills `output_dir` (the run dir lives inside it), `run_config` (the resolved config)
    and, in a sweep, `group` (the sweep) and `name` (the job's overrides)."""

    stops_alike = True  # never stops training between steps

    rank_zero_only = True

    def __init__(
        self,
        project: str = "hydraspeed",
        output_dir: str | None = None,
        run_config: dict[str, Any] | None = None,
        group: str | None = None,
        name: str | None = None,
        mode: str | None = None,
        tags: list[str] | None = None,
    ):
        self.project, self.output_dir = project, output_dir
        # plain JSON values: wandb's config sanitiser rejects some containers
        self.config = json.loads(json.dumps(run_config, default=str)) if run_config is not None else None
        self.group, self.name, self.mode, self.tags = group, name, mode, tags
        self.run: Any = None

    def _resolve_mode(self) -> str:
        mode = self.mode or os.environ.get("WANDB_MODE")
        if mode:
            return mode
        if os.environ.get("WANDB_API_KEY"):
            return "online"
        netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
            return "online"  # `wandb login` stores the key there
        return "offline"

    def on_fit_start(self, state: LoopState) -> None:
        """Start the wandb run inside the output dir."""
        import wandb

        mode: Any = self._resolve_mode()
        if mode == "disabled":
            return
        kwargs: dict[str, Any] = dict(
            project=self.project,
            dir=self.output_dir,
            config=self.config,
            group=self.group,
            name=self.name,
            tags=self.tags,
            settings=wandb.Settings(
                silent=True, init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 30))
            ),
        )
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as exc:
            if mode == "offline":
                raise
            print(
                f"wandb: could not reach the server ({exc.__class__.__name__}); continuing offline",
                file=sys.stderr,
            )
            mode = "offline"
            self.run = wandb.init(mode=mode, **kwargs)
        requested = self.mode or os.environ.get("WANDB_MODE")
        if mode == "offline" and self.run is not None and requested != "offline":
            print(
                f"wandb: offline run (no API key); upload later with: wandb sync {Path(self.run.dir).parent}"
            )

    def _log(self, data: dict[str, Any], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log({k: v for k, v in data.items() if isinstance(v, (int, float))}, step=step)
        except Exception as exc:  # never kill training for a logging failure
            print(f"wandb: logging failed ({exc}); continuing", file=sys.stderr)

    def on_step_end(self, state: LoopState) -> None:
        """Log step metrics at logging points."""
        if state.log_now:
            self._log({f"train/{k}": v for k, v in state.logs.items()}, state.global_step)

    def on_epoch_end(self, state: LoopState) -> None:
        """Log the epoch summary."""
        self._log({f"epoch/{k}": v for k, v in state.logs.items()}, state.global_step)

    def on_fit_end(self, state: LoopState) -> None:
        """Finish the run."""
        if self.run is not None:
            self.run.finish()
            self.run = None
