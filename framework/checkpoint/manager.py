"""Saving and loading the stateful parts of a run, and the callback that saves on schedule.

The manager is handed what it saves (torchtitan's way): the runtime (DeepSpeed's weights,
optimizer and scheduler files), the loop state (counters, history, loader position) and the
metrics; it adds this rank's random number generators. It never sees the Engine.
"""

from __future__ import annotations

import errno
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from framework.checkpoint import compatibility, preemption, rng, safety, store
from framework.errors import CheckpointError, ConfigError
from framework.integrations import peft_files
from framework.integrations.hf import save_model_config
from framework.observe.callbacks import Callback
from framework.observe.metrics import Metrics
from framework.observe.state import LoopState
from framework.process import watchdog
from framework.process.context import ProcessContext

if TYPE_CHECKING:
    from framework.backend.runtime import Runtime
    from framework.plan.run_plan import Mesh


@dataclass
class Stateful:
    """The parts of a run a checkpoint holds; `step`: the training step's object, whose window
    between logging points (`step_state`, e.g. DPO's rewards) is kept too (`framework.engine.steps`)."""

    runtime: Runtime
    state: LoopState
    metrics: Metrics
    step: Any = None


# ---------------------------------------------------------------------------- save / load


def rank_state(parts: Stateful) -> dict[str, Any]:
    """Everything this rank needs to continue exactly where it is (plain data and CPU tensors)."""
    return {
        "loop": parts.state.state_dict(),
        "metrics": {"train": parts.metrics.train.state_dict(), "eval": parts.metrics.eval.state_dict()},
        "rng": rng.state(parts.runtime.device),
        "step": parts.step.step_state() if hasattr(parts.step, "step_state") else None,
        "world_size": parts.runtime.world_size,
        "dp_size": parts.runtime.dp_size,
    }


def _check_finite(parts: Stateful) -> None:
    """Before a checkpoint is written: no NaN/inf loss since the last logging point, and finite
    weights on every rank, so the last checkpoint is always a good one."""
    state = parts.state
    bad_loss = state.first_bad_loss()
    assert parts.runtime.module is not None
    finite = [torch.isfinite(p.detach()).all() for p in parts.runtime.module.parameters() if p.numel()]
    bad = bad_loss is not None or not bool(torch.stack(finite).all() if finite else True)
    job = parts.runtime.process
    if job.any_rank(bad):
        step = job.all_reduce_min(bad_loss[0] if bad_loss else state.global_step + 1)
        raise state.non_finite_error(step, bad_loss[1] if bad_loss else math.nan)


def _write_files(parts: Stateful, ckpt_dir: Path, path: Path) -> BaseException | None:
    """This rank's files of checkpoint `path`; the error, if writing failed."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(rank_state(parts), store.rank_file(path, parts.runtime.process.rank))
        parts.runtime.save_checkpoint(str(ckpt_dir), path.name)
    except (OSError, RuntimeError) as exc:
        return exc
    return None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


def _failed_save(
    ckpt_dir: Path, path: Path, exc: BaseException | None, last: str | None, main: bool
) -> CheckpointError:
    """The partial dir is removed (by rank 0: `main`); the message says why (no space: how much was
    needed, how much is free)."""
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
    if main:
        shutil.rmtree(path, ignore_errors=True)
    text = str(exc) if exc is not None else "another rank could not write its files"
    full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    if full or any(s in text for s in ("No space left", "inline_container", "file write failed")):
        complete = store.complete_checkpoints(ckpt_dir)
        need = sum(f.stat().st_size for f in complete[-1].rglob("*") if f.is_file()) if complete else written
        free = shutil.disk_usage(ckpt_dir).free
        return CheckpointError(
            f"no space left in {ckpt_dir} to save {path.name} (need ~{_mib(need)}, {_mib(free)} free); the "
            f"partial save was removed, last good checkpoint: {last or 'none'}"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return CheckpointError(f"saving {path} failed ({first}); last good checkpoint: {last or 'none'}")


def save(
    parts: Stateful, ckpt_dir: str | Path, keep_last_k: int | None = None, reason: str = "request"
) -> Path:
    """Collective: every rank writes its part; rank 0 marks it complete, moves `latest`, prunes.
    A save that fails on any rank leaves no partial dir behind and raises CheckpointError.
    `reason` (schedule, preempted, end, request) is recorded in COMPLETE.json."""
    _check_finite(parts)
    with watchdog.suspended(watchdog.LONG_WORK, "saving a checkpoint"):
        return _save(parts, Path(ckpt_dir), keep_last_k, reason)


def _save(parts: Stateful, ckpt_dir: Path, keep_last_k: int | None, reason: str) -> Path:
    runtime, state = parts.runtime, parts.state
    job = runtime.process
    path = ckpt_dir / store.tag_for(state.global_step)
    if job.is_main and path.exists():  # a partial leftover of an earlier attempt
        shutil.rmtree(path)
    job.barrier()
    error = _write_files(parts, ckpt_dir, path)
    if job.any_rank(error is not None):  # every rank's files are written, or all give up together
        raise _failed_save(ckpt_dir, path, error, state.last_checkpoint, job.is_main)
    if job.is_main:
        save_model_config(runtime.module, path)
        layout = runtime.layout
        meta = {
            "step": state.global_step,
            "epoch": state.epoch,
            "world_size": runtime.world_size,
            "dp_size": runtime.dp_size,
            "tp_size": runtime.mesh.tp_size,
            "micro_batch_size": layout.micro_batch_size if layout else 0,
            "zero_stage": runtime.strategy.sharding.stage,
            "pipeline_stages": runtime.strategy.pipeline.stages,
            "setup": compatibility.setup_record(runtime),
            "method": compatibility.method_record(parts.step),
            "reason": reason,
            "time": time.time(),
        }
        if runtime.adapted:  # which base the adapter trains on: a resume or an export checks it
            meta["base"] = peft_files.base_record(runtime.module)
        store.mark_complete(path, meta)
        if runtime.adapted and state.last_checkpoint is None:  # the run's first: say what it holds
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            print(peft_files.describe_checkpoint(size, runtime.module), flush=True)
        if keep_last_k:
            store.prune(ckpt_dir, keep_last_k)
    job.barrier(slow=True)  # rank 0 flushed, hashed and pruned: possibly long
    return path


def load(parts: Stateful, path: Path) -> None:
    """Load a checkpoint into a built runtime: DeepSpeed's states, then the loop state. Every file
    is verified first (checksums, no code in any pickle); a different setup is named. Rank 0
    says `resumed from step N (path)`."""
    with watchdog.suspended(watchdog.LONG_WORK, "loading a checkpoint"):
        _load(parts, path)
    if parts.runtime.process.is_main:
        print(f"resumed from step {parts.state.global_step} ({path})", flush=True)


def _load(parts: Stateful, path: Path) -> None:
    runtime, state = parts.runtime, parts.state
    job = runtime.process
    meta = store.check(path, job)
    compatibility.check(runtime, path, meta, parts.step)
    load_path, same_layout = compatibility.source(runtime, path, meta)
    try:
        loaded = runtime.load_checkpoint(str(load_path.parent), load_path.name)
    except (ConfigError, CheckpointError):
        raise
    except Exception as exc:  # DeepSpeed's messages rarely name the file
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from None
    if loaded is None:
        raise CheckpointError(
            f"checkpoint {path} could not be loaded (DeepSpeed found no model states in it)"
        )
    saved = safety.load_safely(store.rank_file(load_path, job.rank if same_layout else 0))
    if load_path != path:  # a conversion in the cache, read by every rank now
        store.drop_conversion(load_path, job)
    state.load_state_dict(saved["loop"], with_position=same_layout)
    if same_layout:  # per-rank metric states and generators do not map onto another world size
        parts.metrics.train.load_state_dict(saved["metrics"]["train"], job.device)
        parts.metrics.eval.load_state_dict(saved["metrics"]["eval"], job.device)
        rng.restore(saved["rng"], job.device)
        _load_step_state(parts, [saved["step"]] if saved.get("step") else [])
        return
    # Another layout: continue at the same sample of the epoch's order, with global epoch sums.
    files = {rank: store.rank_file(path, rank) for rank in range(int(meta["world_size"]))}
    every = {rank: safety.load_safely(file) for rank, file in files.items() if file.is_file()}  # checked
    state.load_loss_means([s["loop"] for s in every.values()])
    # a step's window (sums over ranks): every saved rank's on this run's rank 0, none elsewhere
    windows = [s["step"] for s in every.values() if s.get("step")] if job.rank == 0 else []
    _load_step_state(parts, windows)
    tp = int(meta.get("tp_size", 1))  # a tensor-parallel group's ranks count the same samples: one of each
    distinct = [s for rank, s in every.items() if rank % tp == 0]
    for mode in ("train", "eval"):
        merged = [s["metrics"][mode] for s in distinct]
        parts.metrics.for_mode(mode).load_merged(merged, job.device, _takes_merged(runtime.mesh))
    state.loader_state = _stream_position(list(every.values()), saved["loop"].get("loader_state"))
    consumed = state.batches_in_epoch * int(meta["micro_batch_size"]) * int(meta["dp_size"])
    assert runtime.layout is not None
    state.batches_in_epoch = consumed // (runtime.layout.micro_batch_size * runtime.dp_size)
    per_call = runtime.strategy.accumulation_steps if runtime.strategy.uses_pipeline else 1
    state.step_calls = state.batches_in_epoch // per_call


def _load_step_state(parts: Stateful, states: list[dict[str, Any]]) -> None:
    if hasattr(parts.step, "load_step_state"):
        parts.step.load_step_state(states, parts.runtime.process.device)


def _takes_merged(mesh: Mesh) -> bool:
    """Whether this rank holds the merged metric states of a run saved on another layout: the
    first data-parallel replica's (every tensor-parallel rank of it, which count the same samples
    in the uninterrupted run too; one sequence-parallel rank; the pipeline's last stage)."""
    last_stage = mesh.pipeline_stages == 1 or mesh.rank // mesh.dp_size == mesh.pipeline_stages - 1
    return mesh.dp_rank == 0 and mesh.sp_rank == 0 and last_stage


def _stream_position(every: list[dict[str, Any]], mine: Any) -> dict[str, Any] | None:
    """A stream's position for another layout: every saving rank's shards (`every`: their rank
    files), merged (a shard's position holds on any layout: `framework.data.streams`); None for
    map-style data."""
    if not (isinstance(mine, dict) and "stream" in mine):
        return None
    shards: dict[Any, Any] = {}
    for theirs in every:
        shards.update((theirs["loop"].get("loader_state") or {}).get("shards", {}))
    return {**mine, "shards": shards}


def newest(ckpt: str | Path, process: ProcessContext | None = None) -> Path:
    """The checkpoint `ckpt`, or the newest complete one in the checkpoints dir `ckpt` (verified;
    every rank of `process` gets rank 0's answer)."""
    found = store.resolve(str(ckpt), None, process)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {ckpt}")
    return found


class CheckpointManager(Callback):
    """Saves every `every_n_steps` optimizer steps, when training ends, and on preemption (at
    the first optimizer-step boundary after every rank agrees that one of them got a preemption signal)."""

    stops_alike = True  # stops only on a preemption every rank agreed on

    def __init__(
        self,
        parts: Stateful,
        ckpt_dir: str | Path,
        every_n_steps: int = 0,
        keep_last_k: int | None = 3,
        handle_preemption: bool = False,
        on_saved: Callable[[], None] | None = None,
        grace_s: float | None = None,
    ):
        self.parts, self.ckpt_dir = parts, Path(ckpt_dir)
        self.every_n_steps, self.keep_last_k = every_n_steps, keep_last_k
        self.handle_preemption = handle_preemption
        self.on_saved = on_saved
        self.last_saved_step = -1
        self._agreement = preemption.Agreement(parts.runtime.process) if handle_preemption else None
        self._deadline = preemption.Deadline(grace_s)  # a step and a save against the grace time
        self._preempted = False

    def save_now(self, reason: str = "request") -> Path:
        """Write a checkpoint of the current step (collective)."""
        began = time.perf_counter()
        path = save(self.parts, self.ckpt_dir, self.keep_last_k, reason)
        self._deadline.saved(time.perf_counter() - began)
        self.last_saved_step = self.parts.state.global_step
        state = self.parts.state
        state.last_checkpoint, state.last_checkpoint_time = str(path), time.time()
        state.checkpoints[state.global_step] = str(path)
        if self.on_saved is not None:
            self.on_saved()
        return path

    def on_fit_start(self, state: LoopState) -> None:
        """Take the checkpoint dir's lock for this run; remove what an interrupted conversion left."""
        store.acquire_lock(self.ckpt_dir, self.parts.runtime.process)
        if self.parts.runtime.process.is_main:
            store.remove_interrupted(self.ckpt_dir)

    def on_step_end(self, state: LoopState) -> None:
        """Save on schedule or after preemption, at optimizer-step boundaries."""
        self._deadline.step_ended()
        if self._agreement is not None and self._agreement.poll():
            self._preempted = True
        if state.global_step == self.last_saved_step or not self.parts.runtime.at_step_boundary():
            return
        if self._preempted:
            self.save_now("preempted")
            preemption.note_saved(state.global_step)
            state.stop_training = True
            state.stop_reason = (
                f"preempted ({preemption.signal_name()}): checkpoint saved at step {state.global_step}"
            )
            state.stop_reason += self._deadline.report()
        elif self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self.save_now("schedule")
            late = self._deadline.late() if self._agreement is not None else None
            if late and self.parts.runtime.process.is_main:
                print(late, flush=True)

    def on_fit_end(self, state: LoopState) -> None:
        """One more checkpoint when training ends (unless this step was just saved); the lock goes back."""
        if self._agreement is not None:
            self._agreement.drain()
        try:
            if state.global_step != self.last_saved_step:
                self.save_now("preempted" if self._preempted else "end")
        finally:
            store.release_lock(self.ckpt_dir)
