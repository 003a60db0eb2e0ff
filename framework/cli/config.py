"""The typed schema of `conf/train.yaml`, registered in Hydra's ConfigStore.

Hydra merges the YAML files onto these dataclasses, so a typo'd key (`trainer.epoch=3`) or a
wrong type (`trainer.batch_size=big`) fails at composition with Hydra's own message. Groups
whose options are arbitrary `_target_` objects (model, optimizer, ...) are `Any`: their keys
are checked against the target's signature when they are instantiated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from framework.errors import ConfigError
from framework.plan.strategy import Strategy
from framework.plan.tune import KNOBS
from framework.process import slurm

# Config groups chosen in train.yaml's defaults list. `+group=x` and `group=x` both select an
# option of these (see framework.cli.argv.normalize).
GROUPS = (
    "model",
    "data",
    "strategy",
    "optimizer",
    "scheduler",
    "trainer",
    "loss",
    "metrics",
    "logger",
    "callbacks",
    "experiment",
    "hparams_search",
    "autotune",
    "objective",
    "adapter",
)


@dataclass
class DataConfig:
    """Where samples come from and how they are loaded."""

    dataset: Any = MISSING  # {_target_: ...} -> framework.data.datasets.Splits(train, valid) or DatasetDict
    shuffle: bool = True  # shuffle the training set each epoch
    shuffle_window: int = 1000  # a stream's examples permuted at a time when shuffled (map-style: unused)
    num_workers: int = 0  # DataLoader worker processes
    prefetch: int = 2  # batches kept ready on the device ahead of the step
    label_key: str = "labels"  # the labels' key in dict batches (the model gets the rest: model(**batch))
    collate_fn: Any = None  # {_target_: ...} turning a list of samples into a batch (default: torch's)


@dataclass
class CheckpointConfig:
    """When and where checkpoints are written."""

    enabled: bool = True
    save_freq: int = 0  # optimizer steps between checkpoints; 0 = only when training ends
    every_n_steps: int | None = None  # deprecated name of save_freq
    keep_last_k: int = 3  # complete checkpoints kept (older ones deleted); 0 keeps all
    dir: str | None = None  # default <output dir>/checkpoints; a stable path lets a re-submitted job find it
    grace_s: float | None = None  # seconds from a preemption signal to the kill (Slurm's KillWait): checked


@dataclass
class TrainerConfig:
    """The training loop's knobs. `batch_size` is global: split over ranks and accumulation steps."""

    epochs: int = 10
    max_steps: int | None = None  # stop after this many optimizer steps
    steps_per_epoch: int | None = None  # cap optimizer steps per epoch
    batch_size: int = 64
    valid_batch_size: int | None = None  # default: batch_size
    valid_steps: int | None = None  # cap the batches of a validation (default: all; a stream: to its end)
    valid_freq: int = 1  # validate every N epochs
    valid_every: int | None = None  # deprecated name of valid_freq
    valid_at_start: bool = False  # also validate before the first step (the starting point of the curve)
    devices: int = 1  # worker processes on this machine (ignored when launched by torchrun/deepspeed/srun)
    accelerator: str = "auto"  # auto (CUDA when torch sees a GPU, unless DS_ACCELERATOR=cpu) | cpu | cuda
    tf32: bool = True  # TF32 matmuls / convolutions on Ampere and newer GPUs (fp32 runs)
    seed: int = 0
    log_freq: int = 10  # optimizer steps between logged lines / metrics.jsonl records
    log_every: int | None = None  # deprecated name of log_freq
    monitor: str = "val_loss"  # the value train.py returns (what sweepers optimise)
    verbose: bool = False  # show DeepSpeed's own logs and full tracebacks
    timeout_s: float = 300.0  # collective timeout: a dead rank fails the job instead of hanging it
    resume: str | None = None  # auto (the newest complete checkpoint in checkpoint.dir, if any) | PATH
    init_from: str | None = None  # start from these weights (safetensors / torch state dict) unless resuming
    peak_tflops: float | None = None  # one device's peak for MFU (default: a table of GPUs, a CPU probe)
    # the field of a dict / ModelOutput the loss and metrics read (default: logits when present)
    output_key: str | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class AutotuneTarget:
    """A cluster that is not here, for planning on paper (`autotune.only=true`)."""

    devices: int | None = None  # ranks of the target (plan with the cost model alone; nothing runs)
    memory_gb: float | None = None  # memory of each target rank in GB (default: autotune.memory_gb)


@dataclass
class AutotuneConfig:
    """`+autotune=search`: the fastest layout that fits, by short trials (framework.plan.tune)."""

    memory_gb: float | None = (
        None  # per-rank budget in GB (2^30 bytes); default: the GPU's, or RAM / local ranks
    )
    margin: float = 0.9  # a layout may use this fraction of the budget
    trial_steps: int = 6  # optimizer steps of each trial (in a fresh worker group)
    warmup_steps: int = 2  # of a trial's steps, the first ones are not timed
    space: list[str] = field(
        default_factory=lambda: list(KNOBS)
    )  # knobs to vary (the rest as the strategy says)
    exhaustive: bool = False  # try every layout, not only the frontier of what just fits (plan/tune.py)
    only: bool = False  # report the trials (or the paper plan) and stop: nothing is trained
    cache: bool = False  # reuse the result of an earlier job of this sweep / day: same model, mesh, batch
    target: AutotuneTarget = field(default_factory=AutotuneTarget)


@dataclass
class ObjectiveConfig:
    """`+objective=dpo`: preference tuning from pairs (data=hf_preference) in place of `loss=`
    (framework.engine.preference)."""

    name: str = "dpo"  # the objective: dpo (the only one so far)
    beta: float = 0.1  # strength of the pull towards the reference model (DPO's beta, IPO's tau)
    loss_type: str = "sigmoid"  # sigmoid: DPO; ipo: IPO (log-probabilities averaged over answer tokens)
    label_smoothing: float = 0.0  # conservative DPO: the share of pairs assumed mislabelled (sigmoid only)
    precompute_reference: bool = (
        False  # true: reference log-probs computed once before training, kept with the data
    )


@dataclass
class AdapterConfig:
    """`+adapter=lora`: train LoRA adapters on a frozen model, with `peft` (framework.engine.construct)."""

    r: int = 8  # rank of each adapter's two matrices
    alpha: int = 16  # scaling numerator: the adapter's output is multiplied by alpha / r
    dropout: float = 0.05  # dropout on the adapter's input (0: the update is deterministic)
    target_modules: Any = (
        "all-linear"  # module names to adapt, or all-linear: every linear layer but the output head
    )
    modules_to_save: list[str] | None = None  # modules trained whole beside the adapters (e.g. [lm_head])
    use_dora: bool = False  # DoRA: weight-decomposed adapters (a magnitude per output feature)


@dataclass
class TrainConfig:
    """Everything one run needs."""

    model: Any = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    strategy: Strategy = field(default_factory=Strategy)
    optimizer: Any = MISSING
    scheduler: Any = None
    loss: Any = MISSING
    metrics: dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    step: Any = None  # a custom training step: {_target_: my.step, _partial_: true}
    eval_step: Any = None  # a custom validation step, the same way
    dry_run: bool = False  # print the per-rank memory estimate and the DeepSpeed config, then exit
    autotune: AutotuneConfig | None = None  # +autotune=search: choose the layout by trials first
    objective: ObjectiveConfig | None = None  # +objective=dpo: train on preference pairs, not loss=
    adapter: AdapterConfig | None = None  # +adapter=lora: train adapters on the frozen model


# Old key -> the name it has now (the Python API's, Paddle's): still accepted, with one line.
RENAMED = {
    "trainer.valid_every": "trainer.valid_freq",
    "trainer.log_every": "trainer.log_freq",
    "trainer.checkpoint.every_n_steps": "trainer.checkpoint.save_freq",
}


def register_configs() -> None:
    """Register the schema so `train.yaml` can name it first in its defaults list."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    # conf/hydra/launcher/slurm.yaml: request GPUs only for a run that uses them
    OmegaConf.register_new_resolver("slurm_gpus", slurm.gpus_per_node, replace=True)
    # ${project_dir:}: the checkout holding train.py, conf/ and examples/ (shipped example files by path)
    OmegaConf.register_new_resolver(
        "project_dir", lambda: str(Path(__file__).resolve().parents[2]), replace=True
    )


# The smallest value each numeric key accepts (a float bound is exclusive); null stays allowed
# where the schema allows it. Checked with the schema, so a value that would crash mid-run
# (a division by valid_every, a slice by keep_last_k) stops the run before it starts.
MINIMUM: dict[str, int | float] = {
    "trainer.epochs": 1,
    "trainer.max_steps": 1,
    "trainer.steps_per_epoch": 1,
    "trainer.batch_size": 1,
    "trainer.valid_batch_size": 1,
    "trainer.valid_steps": 1,
    "data.shuffle_window": 0,
    "trainer.valid_freq": 1,
    "trainer.valid_every": 1,
    "trainer.devices": 1,
    "trainer.log_freq": 1,
    "trainer.log_every": 1,
    "trainer.timeout_s": 5,  # seconds: a rank's start-up alone can take longer than less
    "trainer.checkpoint.save_freq": 0,
    "trainer.checkpoint.every_n_steps": 0,
    "trainer.checkpoint.keep_last_k": 0,
    "trainer.checkpoint.grace_s": 0.0,
    "data.num_workers": 0,
    "data.prefetch": 0,
    "strategy.gradient_clip.max_norm": 0,
    "autotune.memory_gb": 0.0,
    "autotune.margin": 0.0,
    "autotune.trial_steps": 2,
    "autotune.warmup_steps": 1,
    "autotune.target.devices": 1,
    "autotune.target.memory_gb": 0.0,
}


def check_ranges(cfg: Any) -> None:
    """Every key of `MINIMUM` within its range (and finite), or a ConfigError naming it."""
    import math

    from omegaconf import OmegaConf

    for key, low in MINIMUM.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or isinstance(value, bool):
            continue
        bad = not math.isfinite(value) or (value <= low if isinstance(low, float) else value < low)
        if bad:
            bound = f"> {low:g}" if isinstance(low, float) else f">= {low}"
            raise ConfigError(f"{key}={value}: must be a finite number {bound}")


def check_schema(cfg: Any, schema: type = TrainConfig, prefix: str = "") -> None:
    """Reject keys the schema does not know, naming the nearest valid key, and values out of range.

    Hydra lets `+trainer.epoch=3` add a key even to a typed node; this catches it (and any key
    a YAML file added) before the run starts.
    """
    if not prefix:
        check_ranges(cfg)
    import dataclasses
    import difflib

    from omegaconf import DictConfig

    known = {f.name: f for f in dataclasses.fields(schema)}
    for key in cfg.keys() if isinstance(cfg, DictConfig) else []:
        key = str(key)
        name = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown config key '{name}'; {hint}valid keys: {', '.join(known)}")
        field_type = _dataclass_of(schema, known[key])
        if field_type is not None:
            check_schema(cfg[key], field_type, prefix=f"{name}.")


def _dataclass_of(schema: type, f: Any) -> type | None:
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    candidate = hints.get(f.name)
    # `X | None` (an optional group such as adapter or autotune): its keys are checked as X's
    options = [candidate, *typing.get_args(candidate)]
    return next((c for c in options if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def schema_field(path: list[str]) -> tuple[Any, str] | None:
    """(type, dotted prefix) of the schema field at `path`, or None when the path leaves the
    typed part of the schema (an `Any` node such as model or optimizer)."""
    import dataclasses
    import typing

    node: Any = TrainConfig
    for depth, part in enumerate(path):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            import difflib

            prefix = ".".join(path[:depth])
            close = difflib.get_close_matches(part, list(hints), n=1)
            full = f"{prefix}.{part}" if prefix else part
            hint = f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown config key '{full}'; {hint}valid keys here: {', '.join(hints)}")
        node = hints[part]
    return node, ".".join(path)


_SCALARS = {int: "an integer", float: "a number", bool: "true or false"}


def check_override(item: str) -> None:
    """Reject an override of the typed schema (trainer.*, data.*, strategy.*, ...) whose key does
    not exist (naming the nearest) or whose value has the wrong type, before Hydra parses it."""

    key, sep, value = item.lstrip("+~").partition("=")
    if not sep or "/" in key or key.startswith("hydra") or key in GROUPS:
        return
    parts = key.split(".")
    if parts[0] not in ("trainer", "data", "strategy") or len(parts) < 2:
        return
    found = schema_field(parts)
    if found is None:
        return
    field_type, full = found
    optional = typing_optional(field_type)
    scalar = optional or field_type
    if scalar not in _SCALARS or any(ch in value for ch in ",()[]{}$*") or (optional and value == "null"):
        return
    try:
        if scalar is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
        else:
            scalar(value)
    except ValueError:
        raise ConfigError(f"{full}={value}: expected {_SCALARS[scalar]}") from None


def typing_optional(tp: Any) -> Any:
    """X for `X | None`, else None."""
    import typing

    args = typing.get_args(tp)
    if len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None
