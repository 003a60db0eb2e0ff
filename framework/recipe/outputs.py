"""What a run writes beside its metrics (its resolved config, the DeepSpeed config it really
received, the final metrics) and what `dry_run` prints (per-rank model-state memory, the
DeepSpeed config)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from framework.backend import parallel
from framework.engine import Engine
from framework.observe.callbacks import Callback
from framework.observe.state import LoopState

CONFIG_FILE = "config.yaml"


def write_config(tree: dict[str, Any], output_dir: Path) -> Path:
    """The run's resolved config tree as `config.yaml` (what `framework.build` can replay)."""
    path = output_dir / CONFIG_FILE
    path.write_text(yaml.safe_dump(tree, sort_keys=False, default_flow_style=False))
    return path


class RunFiles(Callback):
    """Rank 0 writes the DeepSpeed config that the engine really received, then the final metrics."""

    rank_zero_only = True

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir

    def on_fit_start(self, state: LoopState) -> None:
        """deepspeed_config.json next to the resolved config."""
        with open(self.output_dir / "deepspeed_config.json", "w") as f:
            json.dump(state.info.deepspeed_config, f, indent=2)

    def on_fit_end(self, state: LoopState) -> None:
        """final_metrics.json: the last value of each logged quantity."""
        final = {k: v[-1] for k, v in state.history.items() if v}
        final.update(step=state.global_step, batches=state.batches_fetched, samples=state.samples_seen)
        with open(self.output_dir / "final_metrics.json", "w") as f:
            json.dump(final, f, indent=2, default=float)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_plan(engine: Engine) -> None:
    """What `dry_run` prints: per-rank model-state memory and the DeepSpeed config."""
    cost = engine.cost("train")
    runtime = engine.runtime
    parallel.check_model(runtime.strategy, runtime.mesh, engine.module)  # what training would refuse
    print(
        f"{type(engine.module).__name__}: {cost['parameters']:,} parameters (largest tensor "
        f"{cost['largest_parameter']:,}) | {runtime.strategy.describe()} | {runtime.mesh.describe()}"
    )
    parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "buffer_bytes")
    print(
        f"per-rank model states: {cost['parameters_per_rank']:,} parameters, "
        + ", ".join(f"{k.removesuffix('_bytes')} {_size(cost[k])}" for k in parts)
        + f" = {_size(cost['total_bytes'])} (device {_size(cost['device_bytes'])}, cpu {_size(cost['cpu_bytes'])})"
    )
    if cost["deepspeed_estimate"]:
        est = cost["deepspeed_estimate"]
        print(
            f"DeepSpeed's estimator (fp16 mixed precision): device {_size(est['device_bytes'])}, "
            f"cpu {_size(est['cpu_bytes'])}"
        )
    print("DeepSpeed config: " + json.dumps(runtime.deepspeed_config_for(engine.module)))
