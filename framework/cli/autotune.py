"""`+autotune=search`: before a job trains, the layouts `framework.plan.tune` proposes are tried for
a few optimizer steps each, every trial in a fresh worker group started the way every run starts
its workers (`framework.process.launch.spawn`), and the job trains with the fastest that fits::

    launch_job -> tune(cfg, output_dir) -> cfg with the chosen layout (None: autotune.only)
      each trial: spawn(trial_worker, trainer.devices) -> (peak GB per rank, samples/s, error)

Files in the run dir: `autotune.json` (the budget, the choice, every trial) and each trial's
console in `autotune/trial-N.log`. A job started again in the same dir (a Slurm requeue, a
resume) takes the layout its `autotune.json` chose instead of searching again: a checkpoint
resumes into the layout that wrote it. With `autotune.cache=true` a job reuses the result of an
earlier job of the same sweep (or day) with the same model, data, mesh and global batch.
`autotune.target` plans for a cluster that is not here, from the cost model alone.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from framework.backend import deepspeed_globals
from framework.backend.estimate import model_facts
from framework.backend.runtime import Runtime
from framework.cli.build import tree
from framework.data.datasets import as_splits
from framework.engine import autotune as measured
from framework.errors import ConfigError
from framework.plan import paper, tune
from framework.process.context import ProcessContext
from framework.process.environment import choose_accelerator, device_memory_bytes, launched
from framework.process.launch import WorkerFailed, spawn
from framework.recipe import build_engine, seed_everything, tree_of
from framework.recipe.build import strategy_of
from framework.recipe.model import meta_model
from framework.recipe.targets import instantiate as make

RESULT = "autotune.json"


def with_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A copy of `cfg` with `key=value` overrides applied (values read as YAML scalars)."""
    out = copy.deepcopy(cfg)
    for item in overrides:
        key, _, value = item.partition("=")
        OmegaConf.update(out, key, yaml.safe_load(value), merge=False)
    return out


def tune_job(cfg: DictConfig, output_dir: str) -> DictConfig | None:
    """The search for this job (see the module doc): `cfg` with the chosen layout, or None when
    nothing is to be trained (`autotune.only`)."""
    a = cfg.autotune
    out = Path(output_dir)
    base = strategy_of(tree_of(tree(cfg)))
    tune.check_searchable(base)
    if a.target.devices is not None:
        _on_paper(cfg, base, out)
        return None
    if launched():
        raise ConfigError(
            "autotune starts a worker group of its own for each trial: run the search with `python train.py "
            "trainer.devices=N ...` on one machine and pin the layout it prints for the launched run "
            "(autotune.target with autotune.only=true plans a cluster on paper from anywhere)"
        )
    key = _key(cfg)
    earlier = _earlier_result(cfg, out, key)
    if earlier is not None:
        return None if a.only else with_overrides(cfg, earlier["chosen"]["overrides"])
    accelerator = choose_accelerator(str(cfg.trainer.accelerator))
    devices, batch = int(cfg.trainer.devices), int(cfg.trainer.batch_size)
    budget = float(a.memory_gb) if a.memory_gb is not None else _device_memory_gb(accelerator, devices)
    nodes = tree(cfg)
    facts = model_facts(meta_model(nodes["model"]), base, make(nodes["optimizer"], "optimizer"), devices)
    offload = accelerator == "cuda"
    trials = tune.trials_for(
        tune.candidates(base, facts, devices, batch, a.space, offload), base, facts, devices, batch
    )
    print(
        f"autotune: {len(trials)} layout(s) of a global batch of {batch} on {devices} rank(s), {budget:.3g} GB each"
    )
    started = time.time()
    chosen = tune.run_search(
        trials,
        budget,
        float(a.margin),
        lambda t: _trial(cfg, t, out, trials.index(t)),
        exhaustive=bool(a.exhaustive),
    )
    seconds = _seconds(trials, time.time() - started, int(a.trial_steps), batch)
    result = tune.report(budget, float(a.margin), chosen, trials, key=key, seconds=seconds)
    _write(out / RESULT, result)
    if a.cache and chosen is not None:
        _write(_cache_file(out, key), result)
    if chosen is None:
        raise tune.nothing_fits(trials, budget, float(a.margin), offload)
    print(
        f"autotune: {chosen.name}: {chosen.samples_per_s:.1f} samples/s, peak {chosen.peak_gb:.3g} GB of {budget:.3g} GB "
        f"({why_chosen(chosen, trials)}); "
        f"{seconds['trials']:.0f} s for {seconds['tried']} trial(s) ({seconds['steps']:.0f} s of steps, the rest "
        f"process start-up and building); pin it with: {' '.join(chosen.layout.overrides())}"
    )
    if a.only:
        print("autotune.only=true: nothing trained")
        return None
    return with_overrides(cfg, chosen.layout.overrides())


def _seconds(trials: list[tune.Trial], total: float, steps: int, batch: int) -> dict[str, Any]:
    """What the search took: in all, and in the trials' own optimizer steps."""
    tried = [t for t in trials if "seconds" in t.extra]
    in_steps = sum(steps * batch / t.samples_per_s for t in tried if t.samples_per_s)
    return {"trials": round(total, 1), "steps": round(in_steps, 1), "tried": len(tried)}


def _trial(
    cfg: DictConfig, trial: tune.Trial, out: Path, index: int
) -> tuple[float | None, float | None, str | None]:
    """One trial in a fresh group of `trainer.devices` workers; its console goes to a log file."""
    container = OmegaConf.to_container(with_overrides(cfg, trial.layout.overrides()), resolve=True)
    log = out / "autotune" / f"trial-{index}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        result = spawn(
            trial_worker, (container, str(log)), int(cfg.trainer.devices), float(cfg.trainer.timeout_s)
        )
    except WorkerFailed as exc:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        result = (None, None, f"{lines[-1].strip()[:200]} ({log})")
    trial.extra["seconds"] = round(time.time() - started, 1)
    return result


@record
def trial_worker(container: dict[str, Any], log: str) -> tuple[float | None, float | None, str | None]:
    """One rank of a trial (a fresh process): build the job's engine under the trial's layout and
    measure a few optimizer steps (`framework.engine.autotune.measure`)."""
    cfg = OmegaConf.create(container)
    full = tree_of(container)
    t, a = cfg.trainer, cfg.autotune
    with _console_to(Path(log)):
        deepspeed_globals.quiet(bool(t.verbose), choose_accelerator(str(t.accelerator)))
        job = ProcessContext.start(str(t.accelerator), float(t.timeout_s), tf32=bool(t.tf32))
        with job:
            seed_everything(int(t.seed))
            splits = as_splits(make(full["data"]["dataset"], "data.dataset"))

            def make_engine(strategy: Any) -> Any:
                runtime = Runtime(strategy, job)
                runtime.fix_layout(int(t.batch_size))
                return build_engine(full, runtime, callbacks=[])

            collate = (
                make(full["data"]["collate_fn"], "data.collate_fn")
                if full["data"]["collate_fn"]
                else getattr(splits, "collate_fn", None)
            )
            options = measured.trial_options(
                int(t.batch_size),
                int(a.trial_steps),
                shuffle=bool(cfg.data.shuffle),
                collate_fn=collate,
                num_workers=int(cfg.data.num_workers),
                shuffle_window=int(cfg.data.shuffle_window),
                timeout_s=float(t.timeout_s),
            )
            return measured.measure(
                make_engine, strategy_of(full), splits.train, options, job, int(a.warmup_steps), catch=False
            )


@contextlib.contextmanager
def _console_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2) into `path` (appended), rank by rank."""
    with open(path, "a") as log:
        saved = [os.dup(1), os.dup(2)]
        try:
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            yield
        finally:
            for fd, copy_of in zip((1, 2), saved):
                os.dup2(copy_of, fd)
                os.close(copy_of)


def _device_memory_gb(accelerator: str, devices: int) -> float:
    """The default budget: a GPU's memory (read by nvidia-smi, so this process leaves CUDA alone
    while the trials run), or this machine's memory over the ranks on it."""
    if accelerator == "cuda":
        import subprocess

        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
            found = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            return min(float(v) for v in found) * 2**20 / tune.GB  # MiB
    return device_memory_bytes(accelerator, 0, devices) / tune.GB


def _key(cfg: DictConfig) -> str:
    """What fixes a search's result: the model, the data, the processes, the global batch, the
    strategy as given, the optimizer's kind (not its learning rate: a sweep over it reuses one
    search) and the search's own settings."""
    parts = {name: OmegaConf.to_container(cfg[name], resolve=True) for name in ("model", "data", "strategy")}
    parts["optimizer"] = str(cfg.optimizer.get("_target_"))
    a = cfg.autotune
    parts["run"] = [int(cfg.trainer.devices), int(cfg.trainer.batch_size), str(cfg.trainer.accelerator)]
    parts["search"] = [a.memory_gb, a.margin, list(a.space), a.trial_steps, a.warmup_steps, a.exhaustive]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cache_file(out: Path, key: str) -> Path:
    return out.parent / ".autotune" / f"{key}.json"


def _earlier_result(cfg: DictConfig, out: Path, key: str) -> dict[str, Any] | None:
    """This run dir's own result (the same job started again), else the cache's (`autotune.cache`)."""
    places = [(out / RESULT, "this run dir's autotune.json (an earlier start of this job)")]
    if cfg.autotune.cache:
        places.append((_cache_file(out, key), "autotune.cache"))
    for path, what in places:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if result.get("key") == key and result.get("chosen"):
            print(
                f"autotune: {result['chosen']['layout']} from {what}; pin it with: {' '.join(result['chosen']['overrides'])}"
            )
            if path != out / RESULT:
                _write(out / RESULT, result)
            return result
    return None


def _on_paper(cfg: DictConfig, base: Any, out: Path) -> None:
    """`autotune.target`: the layouts for a cluster that is not here, ranked by the cost model."""
    a = cfg.autotune
    if not a.only:
        raise ConfigError(
            "autotune.target plans for a cluster that is not here: nothing can be trained on it from this "
            "machine; add autotune.only=true (or drop autotune.target to tune on this machine)"
        )
    memory = a.target.memory_gb if a.target.memory_gb is not None else a.memory_gb
    if memory is None:
        raise ConfigError("autotune.target.memory_gb: give the memory of each target rank in GB (e.g. 80)")
    devices, batch = int(a.target.devices), int(cfg.trainer.batch_size)
    nodes = tree(cfg)
    model = meta_model(nodes["model"])
    facts = model_facts(model, base, make(nodes["optimizer"], "optimizer"), devices)
    trials = paper.on_paper(base, facts, devices, float(memory), float(a.margin), batch, a.space)
    print(
        f"autotune on paper: {type(model).__name__} ({facts.parameters:,} parameters) on {devices} x {float(memory):g} GB"
    )
    print("\n".join(paper.table(trials)))
    chosen = trials[0] if trials and trials[0].fits else None
    _write(
        out / RESULT,
        tune.report(float(memory), float(a.margin), chosen, trials, plan="paper", devices=devices),
    )
    if chosen is None:
        raise tune.nothing_fits(trials, float(memory), float(a.margin), offload_possible=True)
    print(f"autotune on paper: {chosen.name} first; pin it with: {' '.join(chosen.layout.overrides())}")


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def why_chosen(chosen: tune.Trial, trials: Sequence[tune.Trial]) -> str:
    """Why `choose` took `chosen`: the fastest that fits, or within `tune.TIE` of a faster one and simpler."""
    fitting = [t for t in trials if t.fits and t.samples_per_s]
    fastest = max(fitting, key=lambda t: t.samples_per_s or 0.0)
    if fastest is chosen:
        return "the fastest layout that fits"
    gap = 1 - (chosen.samples_per_s or 0.0) / (fastest.samples_per_s or 1.0)
    return (
        f"within {100 * gap:.1f} % of the fastest, {fastest.name} ({fastest.samples_per_s:.1f} samples/s), and "
        f"simpler: layouts within {100 * tune.TIE:.0f} % count as equally fast, and the simplest of them wins"
    )
