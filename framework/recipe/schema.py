"""The config tree a run is built from: one node per part, typed by the dataclasses the Python
API takes (the CLI registers these same classes as Hydra's schema; yaml files select and
override, they do not restate defaults).

    model       any `_target_` (a config group)           strategy  `Strategy`
    data        `DataConfig` (`LoaderConfig` + dataset)     trainer   `TrainerConfig` (`LoopConfig` + the run's)
    adapter     `AdapterConfig` (LoRA / DoRA)               objective a method's options (`framework.methods`)
    optimizer, scheduler, loss, metrics, logger, callbacks, step, eval_step: `_target_` nodes

A node typed `Any` is checked against its target's signature when it is made
(`framework.recipe.targets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.engine.fit_config import LoaderConfig, LoopConfig, SaveConfig
from framework.integrations.peft import AdapterConfig
from framework.plan.strategy import Strategy
from framework.plan.tune import KNOBS

MISSING = "???"  # a value the config must give (OmegaConf's marker)


@dataclass
class DataConfig(LoaderConfig):
    """Where samples come from and how they are loaded."""

    dataset: Any = MISSING  # {_target_: ...} -> framework.data.datasets.Splits(train, valid) or DatasetDict
    prefetch: int = 2  # batches kept ready on the device ahead of the step
    label_key: str = "labels"  # the labels' key in dict batches (the model gets the rest: model(**batch))


@dataclass
class CheckpointConfig(SaveConfig):
    """When and where checkpoints are written."""

    enabled: bool = True  # write checkpoints at all
    every_n_steps: int | None = None  # deprecated name of save_freq
    dir: str | None = None  # default <output dir>/checkpoints; a stable path lets a re-submitted job find it
    # seconds from a preemption signal to the kill (Slurm's KillWait): a warning when a measured
    # step and save exceed it, and the margin left in the preemption message
    grace_s: float | None = None


@dataclass
class TrainerConfig(LoopConfig):
    """The training loop's knobs (`LoopConfig`'s, as `Engine.fit` names them) and the run's."""

    devices: int = 1  # worker processes on this machine (ignored when launched by torchrun/deepspeed/srun)
    accelerator: str = "auto"  # auto (CUDA when torch sees a GPU, unless DS_ACCELERATOR=cpu) | cpu | cuda
    tf32: bool = True  # TF32 matmuls / convolutions on Ampere and newer GPUs (fp32 runs)
    seed: int = 0  # seed of the weights' initialisation and of the data shuffling
    # the value train.py returns (what sweepers optimise); unset: val_loss with validation data, else loss
    monitor: str | None = None
    verbose: bool = False  # show DeepSpeed's own logs and full tracebacks
    init_from: str | None = None  # start from these weights (safetensors / torch state dict) unless resuming
    # the field of a dict / ModelOutput the loss and metrics read (default: logits when present)
    output_key: str | None = None
    valid_every: int | None = None  # deprecated name of valid_freq
    log_every: int | None = None  # deprecated name of log_freq
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class AutotuneTarget:
    """A cluster that is not here, for planning on paper (`autotune.only=true`)."""

    devices: int | None = None  # ranks of the target (plan with the cost model alone; nothing runs)
    memory_gb: float | None = None  # memory of each target rank in GB (default: autotune.memory_gb)


@dataclass
class AutotuneConfig:
    """`+autotune=search`: the fastest layout that fits, by short trials (framework.plan.tune),
    run by the command line before the run is built."""

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
class RunConfig:
    """Everything one run needs."""

    model: Any = MISSING  # the model: a config group (model=mlp) or any _target_
    data: DataConfig = field(default_factory=DataConfig)
    strategy: Strategy = field(default_factory=Strategy)
    optimizer: Any = MISSING  # a torch optimizer factory (_partial_: true): a config group or any _target_
    scheduler: Any = None  # a learning-rate schedule factory stepped once per optimizer step
    loss: Any = MISSING  # loss(outputs, labels) -> scalar, or model for the loss the model computes itself
    metrics: dict[str, Any] = field(
        default_factory=dict
    )  # torchmetrics-style metrics by name, synced across ranks
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # loggers by name (console, wandb, tensorboard, mlflow); metrics.jsonl is always written
    logger: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)  # extra callbacks by name (early_stopping, ...)
    step: Any = None  # a custom training step: {_target_: my.step, _partial_: true}
    eval_step: Any = None  # a custom validation step, the same way
    dry_run: bool = False  # print the per-rank memory estimate and the DeepSpeed config, then exit
    autotune: AutotuneConfig | None = None  # +autotune=search: choose the layout by trials first
    # +objective=NAME: a training method of framework.methods (dpo, simpo, orpo, sft) in place of
    # loss=; its options are the method's (name: its registry name or a Method's import path)
    objective: Any = None
    adapter: AdapterConfig | None = None  # +adapter=lora: train adapters on the frozen model


# Old key -> the name it has now (the Python API's, Paddle's): still accepted, with one line.
RENAMED = {
    "trainer.valid_every": "trainer.valid_freq",
    "trainer.log_every": "trainer.log_freq",
    "trainer.checkpoint.every_n_steps": "trainer.checkpoint.save_freq",
}
