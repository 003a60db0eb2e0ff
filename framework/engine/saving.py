"""`Engine.save` and `Engine.load`: full checkpoints (weights, optimizer, loop state, a step's
window) and consolidated weights files, on the `framework.engine.evaluation.Host` protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from framework import checkpoint
from framework.backend import weights
from framework.engine.evaluation import Host
from framework.engine.steps import owner
from framework.errors import ConfigError


def stateful(host: Host) -> checkpoint.Stateful:
    """What a checkpoint of the host holds."""
    return checkpoint.Stateful(host.runtime, host.state, host.metrics, owner(host.train_step_fn))


def save(host: Host, path: str, training: bool = True) -> str:
    """A full checkpoint under the checkpoints dir `path` (`training`), else the consolidated
    fp32 weights in one file (see `Engine.save`). Returns what was written."""
    if not host.runtime.ready:
        raise ConfigError("nothing to save yet: prepare(mode=...) or fit() first")
    if training:
        return str(checkpoint.save(stateful(host), path))
    return str(weights.save_consolidated(host.runtime, path))


def load(host: Host, path: str, trains: bool) -> None:
    """A checkpoint (dir: weights, optimizer and loop state) or a weights file into the host,
    prepared first for training (`trains`: it has what training needs) or prediction. After a
    weights file, a training method that follows the weights (`weights_loaded`: DPO's frozen
    reference) is told."""
    runtime = host.runtime
    found = checkpoint.newest(path, runtime.process) if Path(path).is_dir() else None
    if not runtime.ready:
        if found is not None:  # ZeRO partitions of another data-parallel size: DeepSpeed must know
            runtime.load_universal = checkpoint.needs_universal(found, runtime.mesh)
        host.prepare("train" if trains else "predict")
    if found is not None:
        checkpoint.load(stateful(host), found)
        host.state.info.resumed_from = str(found)
        return
    runtime.load_full_state_dict(weights.load_weights(path))
    loaded: Any = getattr(host.train_step_fn, "weights_loaded", None)
    if callable(loaded):
        loaded(host)
