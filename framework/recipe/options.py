"""The nodes of a config tree as the API's objects and options: `fit`'s options, the resume
choice, the monitored value, loggers and callbacks, the optimizer, a method. Each maps by the
names the API's dataclasses define (`framework.engine.fit_config`), never option by option.

A ConfigError raised by an API object about one of its options (`ConfigError.about`) is
reworded here with the config key (`with_key`, `made`).
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import Any

from framework.engine.fit_config import FitConfig, LoaderConfig, LoopConfig, SaveConfig, shared
from framework.errors import ConfigError
from framework.integrations import hf
from framework.observe.callbacks import Callback
from framework.observe.loggers import MetricsFile
from framework.observe.samples import SamplesFile
from framework.process import slurm
from framework.recipe.outputs import RunFiles
from framework.recipe.targets import instantiate, locate
from framework.recipe.tree import renamed


def with_key(key: str, fn: Any, *args: Any) -> Any:
    """Call `fn`; a ConfigError names the config key it is about."""
    try:
        return fn(*args)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc.reason if exc.option else exc}") from None


def made(key: str, cls: type, node: dict[str, Any]) -> Any:
    """`cls(**node)`, an error about one of its options worded with the key (`objective.beta=0:
    must be > 0`)."""
    try:
        return cls(**node)
    except ConfigError as exc:
        raise ConfigError(exc.at(key)) from None


def fit_options(tree: dict[str, Any], ckpt_dir: Path, data_collate: Any, main: bool = True) -> FitConfig:
    """`Engine.fit`'s options from the `trainer`, `trainer.checkpoint` and `data` nodes, by the
    names `LoopConfig`, `SaveConfig` and `LoaderConfig` define (`main`: this rank says what is
    deprecated, and that a requeued Slurm job resumes)."""
    t, data, ck = tree["trainer"], tree["data"], tree["trainer"]["checkpoint"]
    loop = shared(LoopConfig, t)
    loop.update(
        valid_freq=renamed(tree, "trainer.valid_every", main),
        log_freq=renamed(tree, "trainer.log_every", main),
        resume=resume_choice(tree, main),
        timeout_s=float(t["timeout_s"]) if t["timeout_s"] is not None else None,
    )
    saving = dict(shared(SaveConfig, ck), save_freq=renamed(tree, "trainer.checkpoint.every_n_steps", main))
    loader = shared(LoaderConfig, data)
    loader["collate_fn"] = instantiate(loader.get("collate_fn"), "data.collate_fn") or data_collate
    options = FitConfig(
        **loop,
        **loader,
        **saving,
        save_dir=str(ckpt_dir) if ck["enabled"] else None,
        preemption_grace_s=ck["grace_s"],
        progress=False,  # the logger group decides what the console shows
    )
    return options


def resume_choice(tree: dict[str, Any], main: bool = True) -> str | None:
    """`trainer.resume`; unset in a requeued Slurm job (the time limit or a preemption stopped its
    earlier attempt, which saved), `auto`: the attempt goes on from the newest checkpoint (rank 0,
    `main`, says so)."""
    t = tree["trainer"]
    if t["resume"] is None and t["checkpoint"]["enabled"] and slurm.requeued():
        if main:
            print(
                f"slurm: requeued (attempt {int(os.environ['SLURM_RESTART_COUNT']) + 1}): trainer.resume=auto"
            )
        return "auto"
    return None if t["resume"] is None else str(t["resume"])


def checkpoint_dir(tree: dict[str, Any], output_dir: str | Path) -> Path:
    """Where this run's checkpoints go: `trainer.checkpoint.dir`, else `<output dir>/checkpoints`."""
    chosen = tree["trainer"]["checkpoint"]["dir"]
    return Path(chosen) if chosen else Path(output_dir) / "checkpoints"


def tokenizer_from_model_dir(tree: dict[str, Any], main: bool = True) -> None:
    """`data.dataset.tokenizer` left unset and a model loaded from a directory that holds a
    tokenizer: that one (said in one line by rank 0, `main`; the saved config.yaml records it)."""
    node = tree["data"]["dataset"]
    if not isinstance(node, dict) or "tokenizer" not in node or node["tokenizer"] is not None:
        return
    found = hf.tokenizer_dir(tree["model"])
    if found is not None:
        node["tokenizer"] = str(found)
        if main:
            print(f"data: the tokenizer of {found} (the model's directory; data.dataset.tokenizer to change)")


def checked_optimizer(node: Any) -> Any:
    """The optimizer factory; a learning rate that is not a finite positive number is named."""
    optimizer = instantiate(node, "optimizer")
    lr = getattr(optimizer, "keywords", {}).get("lr")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"optimizer.lr={lr}: must be a finite number > 0")
    return optimizer


def _with_context(node: dict[str, Any], key: str, context: dict[str, Any]) -> Any:
    """A logger or callback, given whichever of this run's `context` entries (output_dir,
    run_config, group, name) its signature asks for and its node leaves unset."""
    try:
        params = inspect.signature(locate(str(node["_target_"]), f"{key}._target_")).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    extra = {k: v for k, v in context.items() if k in params and node.get(k) is None and v is not None}
    if not extra:
        return instantiate(node, key)
    # the context is handed as it is: the run's config is data to record, not nodes to make
    return instantiate({**node, "_partial_": True}, key)(**extra)


def callbacks_of(tree: dict[str, Any], out: Path, context: dict[str, Any]) -> list[Callback]:
    """Loggers and the run's files, then the configured callbacks; loggers write from rank 0
    alone (their `rank_zero_only`, which the loop honours from either door)."""
    found = [
        _with_context(node, f"logger.{k}", context) for k, node in tree["logger"].items() if node is not None
    ]
    found += [MetricsFile(out / "metrics.jsonl"), SamplesFile(out / "completions.jsonl"), RunFiles(out)]
    found += [
        _with_context(node, f"callbacks.{k}", context)
        for k, node in tree["callbacks"].items()
        if node is not None
    ]
    return found


def logged_names(tree: dict[str, Any], has_valid: bool) -> list[str]:
    """Every value a run of `tree` logs (its history): loss, lr and each metric, their `val_`
    versions when there is validation data (also as `start_val_*` with `trainer.valid_at_start`),
    and what the framework's callbacks add (`best_<monitor>`, `lr_step`)."""
    train = ["loss", "lr", *(str(name) for name in tree["metrics"])]
    valid = ["val_loss", *(f"val_{name}" for name in tree["metrics"])] if has_valid else []
    start = [f"start_{name}" for name in valid] if tree["trainer"]["valid_at_start"] else []
    added = []
    for node in (n for n in tree["callbacks"].values() if n is not None):
        target = str(node.get("_target_", ""))
        if target.endswith("KeepBest") and node.get("monitor"):
            added.append(f"best_{node['monitor']}")
        if target.endswith("LearningRateMonitor"):
            added.append("lr_step")
    return train + valid + start + added


def monitor_of(tree: dict[str, Any], has_valid: bool, say: bool = True) -> str:
    """The value the run returns (what sweepers optimise): `trainer.monitor` as written, checked
    against what the run logs (a typo would watch nothing); unset, the validation loss when there
    is validation data and the training loss otherwise (said once, `say`). Each callback's
    `monitor` is checked too. A callback of the user's own may log more values: `trainer.monitor`
    is then not checked."""
    names = logged_names(tree, has_valid)
    written = tree["trainer"]["monitor"]
    callbacks = {str(key): node for key, node in tree["callbacks"].items() if node is not None}
    own = all(str(node.get("_target_", "")).startswith("framework.") for node in callbacks.values())
    keys = [("trainer.monitor", written)] if own else []
    keys += [(f"callbacks.{key}.monitor", node.get("monitor")) for key, node in callbacks.items()]
    for key, value in keys:
        if value is not None and str(value) not in names:
            hint = "" if has_valid else " (this run has no validation data, so no val_* values)"
            raise ConfigError(
                f"{key}={value}: this run logs no such value{hint}; choose one of {', '.join(names)}"
            )
    if written is not None:
        return str(written)
    chosen = "val_loss" if has_valid else "loss"
    if say and not has_valid:
        print("trainer.monitor: loss (no validation data; set trainer.monitor to choose)", flush=True)
    return chosen
