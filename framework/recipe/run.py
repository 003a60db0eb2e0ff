"""`Run`: what `framework.build` returns, one rank's share of a run built from a config tree.

    run = framework.build(OmegaConf.load("outputs/.../config.yaml"), output_dir="replay")
    history = run.fit()            # trains exactly what `python train.py` trains with that config
    run.close()                    # or: with framework.build(...) as run: ...

`fit()` installs the preemption handler (in the main thread, when checkpoints are on), starts
from `trainer.init_from`'s weights (every time: a resumed run's frozen parts, such as an
adapter's base or DPO's reference, come from them too), then calls `Engine.fit` with the options
the tree gave; a `dry_run` prints the plan instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path
from typing import Any

from framework.checkpoint import preemption
from framework.engine.engine import Engine
from framework.engine.fit_config import FitConfig
from framework.errors import CheckpointError
from framework.recipe.outputs import print_plan


class Run:
    """A built run (see the module doc): `engine`, the data (`train_data`, `valid_data`), `fit`'s
    options (`fit_options`), the resolved tree (`config`) and `output_dir`."""

    def __init__(
        self,
        config: dict[str, Any],
        engine: Engine,
        train_data: Any,
        valid_data: Any,
        fit_options: FitConfig,
        output_dir: Path,
        monitor: str,
    ):
        self.config, self.engine = config, engine
        self.train_data, self.valid_data = train_data, valid_data
        self.fit_options, self.output_dir, self.monitor = fit_options, output_dir, monitor
        self.history: dict[str, list[Any]] = {}
        self.console = contextlib.ExitStack()  # rank 0's copy of the console (build enters it)
        self.job: Any = None  # the process context build started for this run

    def fit(self) -> dict[str, list[Any]]:
        """Train (see the module doc) and return the per-epoch history."""
        engine, t = self.engine, self.config["trainer"]
        if self.config["dry_run"]:
            if engine.process.is_main:
                print_plan(engine)
            return {}
        options = self.fit_options
        if options.save_dir is not None and threading.current_thread() is threading.main_thread():
            preemption.install_handler()
            options = dataclasses.replace(options, handle_preemption=True)
        if t["init_from"]:
            self._start_from(str(t["init_from"]), options.batch_size)
        self.history = engine.fit(self.train_data, self.valid_data, config=options)
        if engine.process.is_main and engine.state.stop_reason.startswith("preempted"):
            print(
                f"{engine.state.stop_reason}; resume with trainer.resume=auto "
                f"trainer.checkpoint.dir={options.save_dir}"
            )
        return self.history

    def _start_from(self, path: str, batch_size: int) -> None:
        """The weights of `trainer.init_from` in the model (and in what follows them: a method's
        frozen reference)."""
        self.engine.prepare("train", batch_size)
        try:
            self.engine.load(path)
        except (CheckpointError, FileNotFoundError) as exc:
            raise type(exc)(f"trainer.init_from={path}: {exc}") from None

    def monitored(self) -> float | None:
        """The last value of the monitored quantity (`trainer.monitor`), what a sweeper optimises."""
        values = self.history.get(self.monitor)
        return float(values[-1]) if values else None

    def close(self, sync: bool = True) -> None:
        """End the console copy and the job's process context this run started (`sync`: wait for
        the other ranks; not after a failure, which they may not share)."""
        self.console.close()
        if self.job is not None:
            self.job.close(sync=sync)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(sync=exc[0] is None)
