"""Checkpoints that resume exactly and are never half-written, preemption, and fp32 export.

Layout of a checkpoint dir (`trainer.checkpoint.dir`, default `<output dir>/checkpoints`)::

    step_00000120/                DeepSpeed's own files (every rank writes its shard) plus
        hydraspeed_rank00000.pt   each rank's loop state: counters, RNG, loader position, metrics
        COMPLETE.json             written by rank 0 last, after every rank's files are on disk
    latest                        name of the newest complete checkpoint (moved atomically)

A dir without COMPLETE.json is a save that did not finish: `resume=auto` skips it with a
warning. Our own files load with `torch.load(weights_only=True)`; nothing executes code from a
checkpoint of ours.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from framework import device as dev
from framework.callbacks import Callback, Event, TrainState
from framework.strategy import ConfigError

if TYPE_CHECKING:
    from framework.engine import Engine

COMPLETE = "COMPLETE.json"
LATEST = "latest"
TAG = re.compile(r"^step_(\d+)$")
RANK_FILE = "hydraspeed_rank{rank:05d}.pt"


def tag_for(step: int) -> str:
    """The dir name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------- preemption

_preempt_requested = False


def install_preemption_handler() -> None:
    """SIGTERM (what Slurm sends before preemption) asks for a checkpoint at the next step
    boundary, then a clean exit; a second SIGTERM is left to the default action."""

    def handler(signum: int, frame: Any) -> None:
        global _preempt_requested
        _preempt_requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, handler)


def preempt_requested(agree: bool) -> bool:
    """Whether any rank got SIGTERM (`agree`: decide together, so every rank saves at the same step)."""
    if not agree or not (dist.is_initialized() and dist.get_world_size() > 1):
        return _preempt_requested
    flag = torch.tensor(
        [1.0 if _preempt_requested else 0.0], device=dev.device() if dev.backend() == "nccl" else "cpu"
    )
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# ---------------------------------------------------------------------------- files


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------- loop state


def _metric_states(engine: Engine) -> dict[str, Any]:
    out = {}
    for name, metric in engine.metrics.items():
        states = {k: getattr(metric, k) for k in metric._defaults}
        out[name] = {"states": states, "update_count": int(metric._update_count)}
    return out


def _restore_metrics(engine: Engine, saved: dict[str, Any]) -> None:
    for name, metric in engine.metrics.items():
        if name in saved:
            for key, value in saved[name]["states"].items():
                setattr(metric, key, value.to(dev.device()) if isinstance(value, torch.Tensor) else value)
            metric._update_count = saved[name]["update_count"]
            metric._computed = None


def rank_state(engine: Engine) -> dict[str, Any]:
    """Everything this rank needs to continue exactly where it is (plain data: weights_only-safe)."""
    st = engine.state
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "counters": {
            "epoch": st.epoch,
            "global_step": st.global_step,
            "step_calls": st.step_calls,
            "batches_in_epoch": st.batches_in_epoch,
            "batches_fetched": st.batches_fetched,
            "samples_seen": st.samples_seen,
            "epoch_loss_sum": st.epoch_loss_sum,
            "epoch_loss_count": st.epoch_loss_count,
            "window_loss_sum": st.window_loss_sum,
            "window_loss_count": st.window_loss_count,
            "records_written": st.records_written,
        },
        "history": st.history,
        "loader_state": st.loader_state,
        "metrics": _metric_states(engine),
        "rng": {
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
        "world_size": dev.world_size(),
        "dp_size": engine.dp_size,
    }
    return state


def restore_rank_state(engine: Engine, state: dict[str, Any], same_layout: bool) -> None:
    """Put the loop counters, history and (for the same world size) RNG, loader position and
    metric state back."""
    st = engine.state
    for key, value in state["counters"].items():
        setattr(st, key, value)
    st.history = state["history"]
    if not same_layout:  # per-rank state does not map onto another world size
        st.loader_state = None
        return
    st.loader_state = state["loader_state"]
    _restore_metrics(engine, state["metrics"])
    rng = state["rng"]
    random.setstate(_as_tuple(rng["python"]))
    np_state = rng["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy(), *np_state[2:]))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------- save


def save(engine: Engine, ckpt_dir: str | Path, keep_last_k: int | None = None) -> Path:
    """Collective: every rank writes its part; rank 0 marks it complete, moves `latest`, prunes."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(engine.state.global_step)
    path = ckpt_dir / tag
    if dev.is_main_process() and path.exists():  # a partial leftover of an earlier attempt
        shutil.rmtree(path)
    _barrier()
    path.mkdir(parents=True, exist_ok=True)
    rank_file = path / RANK_FILE.format(rank=dev.rank())
    torch.save(rank_state(engine), rank_file)
    _fsync_file(rank_file)
    engine.ds_engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    _barrier()  # every rank's files are written
    if dev.is_main_process():
        for file in path.rglob("*"):
            if file.is_file():
                _fsync_file(file)
        meta = {
            "step": engine.state.global_step,
            "epoch": engine.state.epoch,
            "world_size": dev.world_size(),
            "dp_size": engine.dp_size,
            "micro_batch_size": engine.layout.micro_batch_size if engine.layout else 0,
            "zero_stage": engine.strategy.sharding.stage,
            "pipeline_stages": engine.strategy.pipeline.stages,
            "time": time.time(),
        }
        _atomic_write(path / COMPLETE, json.dumps(meta, indent=2))
        _atomic_write(ckpt_dir / LATEST, tag)
        if keep_last_k:
            prune(ckpt_dir, keep_last_k)
    _barrier()
    return path


def _step_of(path: Path) -> int:
    match = TAG.match(path.name)
    return int(match.group(1)) if match else -1


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first."""
    found = (
        [p for p in ckpt_dir.iterdir() if TAG.match(p.name) and (p / COMPLETE).is_file()]
        if ckpt_dir.is_dir()
        else []
    )
    return sorted(found, key=_step_of)


def prune(ckpt_dir: Path, keep_last_k: int) -> None:
    """Delete all but the newest `keep_last_k` complete checkpoints (and partial ones older than them)."""
    complete = complete_checkpoints(ckpt_dir)
    keep = {p.name for p in complete[-keep_last_k:]}
    oldest_kept = _step_of(complete[-keep_last_k]) if len(complete) >= keep_last_k else 0
    for p in ckpt_dir.iterdir():
        m = TAG.match(p.name)
        if m and p.name not in keep and int(m.group(1)) < oldest_kept:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------- find / check


def find_resumable(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in `ckpt_dir`; newer partial ones are skipped with a warning."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    tags = sorted((p for p in ckpt_dir.iterdir() if TAG.match(p.name)), key=lambda p: -_step_of(p))
    for path in tags:
        if (path / COMPLETE).is_file():
            return path
        warnings.warn(
            f"skipping partial checkpoint {path} (no {COMPLETE}: its save did not finish)", stacklevel=2
        )
        if dev.is_main_process():
            print(f"warning: skipping partial checkpoint {path} (its save did not finish)", file=sys.stderr)
    return None


def check(path: Path) -> dict[str, Any]:
    """The checkpoint's metadata, or a ConfigError naming the file that is missing or damaged."""
    marker = path / COMPLETE
    if not marker.is_file():
        raise ConfigError(f"checkpoint {path} is incomplete: {marker} is missing (the save did not finish)")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint {path} is damaged: {marker} cannot be read ({exc})") from None
    for file in sorted(path.rglob("*.pt")):
        if not zipfile.is_zipfile(file):
            raise ConfigError(f"checkpoint {path} is damaged: {file} is not a readable torch file")
    return meta


def resolve(resume: str | Path, ckpt_dir: str | Path | None) -> Path | None:
    """`auto` -> the newest complete checkpoint in `ckpt_dir` (None if there is none); a path ->
    that checkpoint, or the newest complete one in that dir."""
    if str(resume) == "auto":
        return find_resumable(ckpt_dir) if ckpt_dir is not None else None
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"trainer.resume={resume}: no such checkpoint")
    if TAG.match(path.name) or (path / COMPLETE).exists():
        check(path)
        return path
    found = find_resumable(path)
    if found is None:
        raise ConfigError(f"trainer.resume={resume}: no complete checkpoint in that dir")
    return found


# ---------------------------------------------------------------------------- load


def needs_universal(path: Path, engine: Engine) -> bool:
    """True when the checkpoint was written with another data-parallel size than this run's."""
    return int(check(path)["dp_size"]) != engine.dp_size


def to_universal(path: Path) -> Path:
    """Convert a ZeRO checkpoint to DeepSpeed's universal format (once; rank 0 converts)."""
    out = path.with_name(path.name + "_universal")
    if dev.is_main_process() and not (out / COMPLETE).is_file():
        meta = check(path)
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(path),
            "--output_folder",
            str(out),
        ]
        if int(meta["zero_stage"]) == 2:
            cmd.append("--inject_missing_state")
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ConfigError(
                f"could not convert {path} for another world size (DeepSpeed's ds_to_universal failed):\n"
                + result.stderr[-2000:]
            )
        for file in path.glob(RANK_FILE.format(rank=0).replace("00000", "*")):
            shutil.copy(file, out / file.name)
        _atomic_write(out / COMPLETE, json.dumps(meta))
    _barrier()
    return out


def load(engine: Engine, path: Path) -> None:
    """Load a checkpoint into a prepared engine: DeepSpeed's states, then the loop state."""
    meta = check(path)
    same_layout = int(meta["dp_size"]) == engine.dp_size and int(meta["world_size"]) == dev.world_size()
    load_path = path if same_layout else to_universal(path)
    try:
        loaded, _ = engine.ds_engine.load_checkpoint(str(load_path.parent), tag=load_path.name)
    except ConfigError:
        raise
    except Exception as exc:  # DeepSpeed's messages rarely name the file
        raise ConfigError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from None
    if loaded is None:
        raise ConfigError(f"checkpoint {path} could not be loaded (DeepSpeed found no model states in it)")
    rank_file = load_path / RANK_FILE.format(rank=dev.rank() if same_layout else 0)
    try:
        state = torch.load(rank_file, weights_only=True)
    except Exception as exc:
        raise ConfigError(f"checkpoint {path} is damaged: {rank_file} cannot be read ({exc})") from None
    restore_rank_state(engine, state, same_layout)
    if not same_layout:  # continue at the same sample of the epoch's order on the new layout
        consumed = (
            state["counters"]["batches_in_epoch"] * int(meta["micro_batch_size"]) * int(meta["dp_size"])
        )
        assert engine.layout is not None
        engine.state.batches_in_epoch = consumed // (engine.layout.micro_batch_size * engine.dp_size)
        per_call = engine.strategy.accumulation_steps if engine.strategy.uses_pipeline else 1
        engine.state.step_calls = engine.state.batches_in_epoch // per_call


class CheckpointManager(Callback):
    """Saves every `every_n_steps` optimizer steps, when training ends, and on preemption."""

    def __init__(
        self,
        ckpt_dir: str | Path,
        every_n_steps: int = 0,
        keep_last_k: int | None = 3,
        handle_preemption: bool = False,
    ):
        self.ckpt_dir = Path(ckpt_dir)
        self.every_n_steps, self.keep_last_k = every_n_steps, keep_last_k
        self.handle_preemption = handle_preemption
        self.last_saved_step = -1

    def _save(self, state: TrainState) -> None:
        assert state.engine is not None
        path = save(state.engine, self.ckpt_dir, self.keep_last_k)
        self.last_saved_step = state.global_step
        state.last_checkpoint = str(path)
        state.engine.fire(Event.CHECKPOINT_SAVED)

    def on_step_end(self, state: TrainState) -> None:
        """Save on schedule (at optimizer-step boundaries) or when preemption was signalled."""
        stepped = (
            state.global_step != self.last_saved_step
            and state.engine is not None
            and state.engine.at_step_boundary()
        )
        if self.handle_preemption and preempt_requested(agree=True):
            self._save(state)
            state.stop_training = True
            state.stop_reason = f"preempted (SIGTERM): checkpoint saved at step {state.global_step}"
        elif stepped and self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._save(state)

    def on_fit_end(self, state: TrainState) -> None:
        """One more checkpoint when training ends (unless this step was just saved)."""
        if state.global_step != self.last_saved_step:
            self._save(state)


# ---------------------------------------------------------------------------- whole weights


def _is_zero3(engine: Engine) -> bool:
    return engine.strategy.sharding.stage == 3 and not engine.strategy.uses_pipeline


def full_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """The module's complete weights on every rank, as CPU tensors: ZeRO-3 partitions gathered;
    pipeline stages collected from the ranks that hold them (the model's own parameter names)."""
    import deepspeed

    module = engine.module
    if engine.strategy.uses_pipeline and engine.ds_engine is not None:
        return _pipeline_state_dict(engine)
    with deepspeed.zero.GatheredParameters(
        list(module.parameters()), modifier_rank=None, enabled=_is_zero3(engine)
    ):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _pipeline_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    pipe = engine.ds_engine.module
    names = {id(m): n for n, m in engine.module.named_modules()}
    mine: dict[str, torch.Tensor] = {}
    for child_name, child in pipe.named_children():
        if child_name == "tied_modules":
            for key, tied in child.items():  # tied layers map onto the model attribute of that name
                mine.update({f"{key}.{k}": v.detach().cpu().clone() for k, v in tied.state_dict().items()})
        elif id(child) in names:
            prefix = names[id(child)]
            mine.update({f"{prefix}.{k}": v.detach().cpu().clone() for k, v in child.state_dict().items()})
    merged: dict[str, torch.Tensor] = {}
    for part in dev.all_gather_object(mine):
        merged.update(part)
    return merged


def load_full_state_dict(engine: Engine, state: dict[str, torch.Tensor]) -> None:
    """Load complete weights into the module (every rank passes the same dict) and refresh
    DeepSpeed's fp32 master copy so the next optimizer step starts from them."""
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(
        list(module.parameters()), modifier_rank=0, enabled=_is_zero3(engine)
    ):
        if not _is_zero3(engine) or dev.rank() == 0:
            module.load_state_dict(state, strict=True)
    optimizer: Any = engine.ds_engine.optimizer if engine.ds_engine is not None else None
    if hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()


def load_optimizer_state(engine: Engine, state: dict[str, Any]) -> None:
    """Load this rank's optimizer state (what `optimizer.state_dict()` gave on this rank).

    DeepSpeed's ZeRO / bf16 optimizers take one state dict per data-parallel rank and pick
    their own; the fp32 master copy is rebuilt from the (already loaded) module weights."""
    optimizer = engine.ds_engine.optimizer
    params = list(inspect.signature(optimizer.load_state_dict).parameters)
    if params and params[0] == "state_dict_list":
        optimizer.load_state_dict([state] * engine.dp_size, load_from_fp32_weights=False)
    else:
        optimizer.load_state_dict(state)
