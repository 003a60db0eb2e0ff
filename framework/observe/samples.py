"""`SamplesFile`: what a training step sampled (GRPO's prompts, completions and rewards, every
`log_completions_every` steps), one JSON object per line in the run's `completions.jsonl`, and,
when a wandb run is active, as a wandb table (`completions`).

A run resumed from a checkpoint keeps the lines up to the checkpoint's step and goes on, so the
file reads as one uninterrupted run. Rank 0 writes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from framework.observe.callbacks import Callback
from framework.observe.state import LoopState


class SamplesFile(Callback):
    """Writes `state.samples` at the end of each step that has some (see the module doc)."""

    stops_alike = True  # never stops training between steps

    rank_zero_only = True

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_fit_start(self, state: LoopState) -> None:
        """A resumed run keeps the samples up to its checkpoint's step."""
        if state.info.resumed_from is not None and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if _step(line) <= state.global_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def on_step_end(self, state: LoopState) -> None:
        """Append this step's samples."""
        if not state.samples:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for record in state.samples:
                f.write(json.dumps(record, default=str) + "\n")
        _to_wandb(state.samples, state.global_step)


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def _to_wandb(samples: list[dict[str, Any]], step: int) -> None:
    """The samples as a table of the active wandb run, if there is one (never stops training)."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return
    columns = list(dict.fromkeys(key for record in samples for key in record))
    try:
        rows = [
            [
                json.dumps(r.get(c), default=str) if isinstance(r.get(c), (list, dict)) else r.get(c)
                for c in columns
            ]
            for r in samples
        ]
        run.log({"completions": wandb.Table(columns=columns, data=rows)}, step=step)  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - a logger never stops training
        print(
            f"wandb: the completions table was not logged ({type(exc).__name__}); continuing", file=sys.stderr
        )
