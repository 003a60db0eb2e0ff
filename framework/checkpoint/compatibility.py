"""Whether a checkpoint fits the run that loads it, and from where DeepSpeed loads it.

* the setup that saved it (`setup_record`, in COMPLETE.json): ZeRO stage, pipeline stages,
  optimizer, parameter names and shapes; another one is named in one line (`check`);
* an adapter's base weights (`peft_files.base_record`): a base replaced on disk is refused (`check`);
* the layout: a checkpoint of ZeRO partitions for another data- or tensor-parallel degree loads
  through DeepSpeed's universal format (`needs_universal`, `source`), converted into a cache that
  the run which saved it never sees (`store.to_universal`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from framework.backend.weights import whole_shape
from framework.checkpoint import store
from framework.errors import CheckpointError
from framework.integrations import peft, peft_files

if TYPE_CHECKING:
    from framework.backend.runtime import Runtime
    from framework.plan.run_plan import Mesh


def check(runtime: Runtime, path: Path, meta: dict[str, Any], step: Any = None) -> None:
    """A CheckpointError naming how the run that saved checkpoint `path` differs from this one
    (its setup, an adapter's base weights, what its adapter computes), and what to do; a changed
    hyperparameter that leaves the trained weights' meaning alone (an adapter's dropout, a
    training method's option) is said in one line by rank 0. `step`: the training step object."""
    now = setup_record(runtime)
    difference = differences(path, meta["setup"], now) if "setup" in meta else None
    if difference:
        raise CheckpointError(difference)
    _check_base(runtime, path, meta)
    if runtime.process.is_main:
        for line in changed_hyperparameters(
            meta.get("setup", {}), now, meta.get("method"), method_record(step)
        ):
            print(f"resume: {line}", flush=True)


def method_record(step: Any) -> dict[str, Any] | None:
    """A training method's name and options (its `config` dataclass), for a checkpoint's metadata."""
    config = getattr(step, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return None
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {"method": type(step).__name__, "options": json.loads(json.dumps(options, default=repr))}


def changed_hyperparameters(
    saved: dict[str, Any], now: dict[str, Any], saved_method: Any, now_method: Any
) -> list[str]:
    """One line per hyperparameter this run changes without changing what the weights mean."""
    lines = []
    old, new = saved.get("adapter") or {}, now.get("adapter") or {}
    if old and new and old.get("lora_dropout") != new.get("lora_dropout"):
        lines.append(
            f"adapter.dropout {old['lora_dropout']} -> {new['lora_dropout']} (the checkpoint trained with the first)"
        )
    if saved_method and now_method and saved_method["method"] == now_method["method"]:
        for key, value in now_method["options"].items():
            before = saved_method["options"].get(key, value)
            if before != value:
                lines.append(
                    f"{now_method['method']} {key} {before} -> {value} (objective.{key}; the checkpoint trained with the first)"
                )
    return lines


def setup_record(runtime: Runtime) -> dict[str, Any]:
    """What a run must match to resume a checkpoint: ZeRO stage, pipeline stages, optimizer class,
    parameter names and whole shapes (as any tensor-parallel degree sees them)."""
    assert runtime.module is not None
    return {
        "zero_stage": runtime.strategy.sharding.stage,
        "pipeline_stages": runtime.strategy.pipeline.stages,
        "optimizer": runtime.optimizer_name,
        "parameters": {n: whole_shape(p) for n, p in runtime.module.named_parameters()},
        "adapter": peft_files.hyperparameters(runtime.module),
    }


def differences(path: Path, saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """One sentence naming how this run differs from the one that saved `path`, and what to do."""
    fresh = (
        f"or start this run from its weights: python -m framework.export {path} weights.safetensors, "
        "then trainer.init_from=weights.safetensors"
    )
    if saved["zero_stage"] != now["zero_stage"] or saved["pipeline_stages"] != now["pipeline_stages"]:
        return (
            f"checkpoint {path} was saved with ZeRO stage {saved['zero_stage']} and {saved['pipeline_stages']} "
            f"pipeline stage(s); this run uses ZeRO stage {now['zero_stage']} and {now['pipeline_stages']}: "
            f"resume with strategy.sharding.stage={saved['zero_stage']}, {fresh}"
        )
    if saved["optimizer"] != now["optimizer"]:
        return (
            f"checkpoint {path} holds {saved['optimizer']} optimizer states; this run uses {now['optimizer']}: "
            f"resume with the same optimizer, {fresh}"
        )
    old, new = saved.get("adapter") or {}, now.get("adapter") or {}
    for key, name in (("lora_alpha", "adapter.alpha"), ("use_dora", "adapter.use_dora")):
        if old and new and old.get(key) != new.get(key):
            return (
                f"checkpoint {path} trained its adapter with {name}={old[key]}; this run sets {name}={new[key]}, "
                f"which changes what the trained weights compute: resume with {name}={old[key]}, {fresh}"
            )
    a, b = saved["parameters"], now["parameters"]
    if a != b:
        names = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b[k])
        shown = ", ".join(f"{n} ({a.get(n, 'absent')} there, {b.get(n, 'absent')} here)" for n in names[:3])
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"checkpoint {path} was saved from another model: {shown}{more}; {fresh}"
    return None


def _check_base(runtime: Runtime, path: Path, meta: dict[str, Any]) -> None:
    """An adapter resumes on the base weights it trained on (rank 0 compares their fingerprint,
    every rank gets its answer): a base replaced on disk is refused, not trained on silently."""
    if not (runtime.adapted and meta.get("base")):
        return
    job = runtime.process
    problem = None
    if job.is_main:
        where = peft.base_name(runtime.module)
        problem = (
            peft_files.other_base(meta["base"], Path(where)) if where else "this run's base has no directory"
        )
    problem = job.broadcast_object(problem, slow=True)
    if problem:
        raise CheckpointError(
            f"checkpoint {path}: {problem}; resume on that base (model.path), or start a new run from it"
        )


def _layout(meta: dict[str, Any]) -> tuple[int, int]:
    """(data-parallel, tensor-parallel) degrees a checkpoint was saved with (TP 1 before it was recorded)."""
    return int(meta["dp_size"]), int(meta.get("tp_size", 1))


def source(runtime: Runtime, path: Path, meta: dict[str, Any]) -> tuple[Path, bool]:
    """Where DeepSpeed loads checkpoint `path` from for this run (it, or its universal conversion for
    another data- or tensor-parallel degree), and whether this run has the checkpoint's layout."""
    (dp, tp), now = _layout(meta), (runtime.dp_size, runtime.mesh.tp_size)
    if (dp, tp) == now and int(meta["world_size"]) == runtime.world_size:
        return path, True
    if int(meta["zero_stage"]) == 0:  # whole weights for one tensor-parallel degree
        if tp == now[1]:
            return path, False
        raise CheckpointError(
            f"checkpoint {path} holds ZeRO-0 weights split over {tp} tensor-parallel ranks, this run uses {now[1]} "
            f"(DeepSpeed converts ZeRO 1-3 only): resume with strategy.tensor_parallel.degree={tp}, or python -m "
            f"framework.export {path} weights.safetensors, then trainer.init_from=weights.safetensors"
        )
    if not runtime.load_universal:
        was, built = (
            f"{d} data-parallel" + (f" x {t} tensor-parallel" if t > 1 else "") for d, t in ((dp, tp), now)
        )
        raise CheckpointError(
            f"checkpoint {path} holds ZeRO partitions for {was} ranks and this engine was already built for "
            f"{built}: load it before anything else runs (Engine.load or fit(resume=...) first)"
        )
    job = runtime.process
    cache = Path(job.broadcast_object(str(store.universal_cache(path)) if job.is_main else None, slow=True))
    universal = store.to_universal(path, job, into=cache)
    store.check(universal, job)
    return universal, False


def needs_universal(path: Path, mesh: Mesh) -> bool:
    """True when the checkpoint holds ZeRO partitions for another layout than `mesh`'s: another
    data-parallel size, or another tensor-parallel degree (DeepSpeed's universal format has
    every parameter whole and re-splits it for the loading run)."""
    meta = store.read_meta(path)
    return _layout(meta) != (mesh.dp_size, mesh.tp_size) and int(meta["zero_stage"]) > 0
