"""`Strategy` (shaped like Paddle's auto-parallel Strategy), its validation, and the batch layout.

Pure: nothing here knows DeepSpeed (its JSON keys live in `framework.backend.ds_config`). Each section
is a small dataclass; the same dataclasses are the Hydra schema of the `strategy` config group,
so a typo'd key or a wrong type fails at composition.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from framework.errors import ConfigError


@dataclass
class Sharding:
    """ZeRO partitioning. `stage` 0 = plain data parallel; 1 = optimizer states; 2 = + gradients;
    3 = + parameters. Size settings left as "auto" are sized from the model (see `framework.plan.cost.auto_sizes`)."""

    stage: int = 0
    offload_optimizer: bool = False  # optimizer states and step on the CPU (stages 1-3)
    offload_params: bool = False  # parameters on the CPU between uses (stage 3 only)
    reduce_bucket_size: Any = "auto"
    allgather_bucket_size: Any = "auto"
    prefetch_bucket_size: Any = "auto"
    param_persistence_threshold: Any = "auto"
    max_live_parameters: Any = "auto"
    max_reuse_distance: Any = "auto"
    sub_group_size: Any = "auto"
    # ZeRO-3: build the model whole and let DeepSpeed partition it, or build it partitioned inside
    # deepspeed.zero.Init (never whole on one rank); auto: whole when it fits (framework.engine.construct)
    init: str = "auto"


@dataclass
class GradientMerge:
    """Gradient accumulation: one optimizer step every `k_steps` micro-batches."""

    k_steps: int = 1


@dataclass
class Amp:
    """Mixed precision. `dtype` is bf16 (works on CPU and GPU) or fp16 (GPU; dynamic loss scaling)."""

    enable: bool = False
    dtype: str = "bf16"


@dataclass
class Recompute:
    """Activation checkpointing: recompute activations in backward instead of storing them."""

    enable: bool = False


@dataclass
class Pipeline:
    """Pipeline parallelism on DeepSpeed's PipelineEngine (used when `stages` > 1).

    `accumulate_steps` micro-batches of `micro_batch_size` (derived from the global batch when
    None) flow through the stages per optimizer step.
    """

    stages: int = 1
    micro_batch_size: int | None = None
    accumulate_steps: int = 1
    schedule: str = "1F1B"
    partition_method: str = "parameters"  # parameters | uniform | type:REGEX
    activation_checkpoint_interval: int = 0


@dataclass
class GradientClip:
    """Clip the global gradient norm to `max_norm` (0 = off)."""

    max_norm: float = 0.0


@dataclass
class TensorParallel:
    """Tensor (model) parallelism on DeepSpeed's AutoTP: each linear layer's weight split over
    `degree` ranks, which see the same batch.

    Which layers split, and how, comes from `plan` when given, else from the model: its own
    `tensor_parallel_plan` (the framework's GPT has one), a Hugging Face model's `tp_plan`, or
    DeepSpeed's `preset` ("llama", "qwen2", "mixtral", ...). A plan maps module names (`*`
    matches one name part, as in `blocks.*.mlp.0`) to "column" (output features split), "row"
    (input features split; outputs summed over the ranks), "replicate", or "column:K" for a fused
    projection of K equal parts (q, k, v in one linear is "column:3").
    """

    degree: int = 1
    plan: dict[str, str] | None = None
    preset: str | None = None


@dataclass
class SequenceParallel:
    """Sequence parallelism (DeepSpeed's Ulysses / ALST) for Hugging Face attention: each of
    `degree` ranks holds a slice of every sequence; attention exchanges heads for sequence with
    all-to-alls. The framework slices the batches and owns the loss reduction."""

    degree: int = 1


@dataclass
class ExpertParallel:
    """Expert parallelism on DeepSpeed's AutoEP: a mixture-of-experts layer's experts split over
    `degree` data-parallel ranks (tokens travel to their experts by all-to-all). `preset` names
    the MoE layout ("mixtral", "qwen3_moe", ...); None detects it from the model."""

    degree: int = 1
    preset: str | None = None


_SECTIONS: dict[str, type] = {
    "sharding": Sharding,
    "gradient_merge": GradientMerge,
    "amp": Amp,
    "recompute": Recompute,
    "pipeline": Pipeline,
    "gradient_clip": GradientClip,
    "tensor_parallel": TensorParallel,
    "sequence_parallel": SequenceParallel,
    "expert_parallel": ExpertParallel,
}


@dataclass
class Strategy:
    """How a model is distributed and optimised. Sections may be given as dicts or dataclasses:
    `Strategy(sharding={"stage": 3}, amp={"enable": True, "dtype": "bf16"})`.

    `deepspeed` is a raw DeepSpeed config merged last, for any key the sections do not model.
    """

    sharding: Sharding = field(default_factory=Sharding)
    gradient_merge: GradientMerge = field(default_factory=GradientMerge)
    amp: Amp = field(default_factory=Amp)
    recompute: Recompute = field(default_factory=Recompute)
    pipeline: Pipeline = field(default_factory=Pipeline)
    gradient_clip: GradientClip = field(default_factory=GradientClip)
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)
    sequence_parallel: SequenceParallel = field(default_factory=SequenceParallel)
    expert_parallel: ExpertParallel = field(default_factory=ExpertParallel)
    compile: bool = False  # also run the module through torch.compile
    deepspeed: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if value is None:
                value = cls()
            elif isinstance(value, dict) or hasattr(value, "items"):
                value = _section_from_dict(name, cls, dict(value))
            elif not isinstance(value, cls):
                raise ConfigError(
                    f"strategy.{name} must be a dict or {cls.__name__}, got {type(value).__name__}"
                )
            setattr(self, name, value)
        self.deepspeed = dict(self.deepspeed or {})
        self.validate()

    @classmethod
    def from_config(cls, node: Any) -> Strategy:
        """Build from a `strategy` mapping (the CLI hands its composed node as a plain dict) or
        pass a Strategy through."""
        if node is None:
            return cls()
        if isinstance(node, Strategy):
            return node
        data = dict(node)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(
                f"unknown strategy key(s) {sorted(unknown)}; valid: {[f.name for f in fields(cls)]}"
            )
        return cls(**data)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (what a run saves next to its resolved config)."""
        return asdict(self)

    def describe(self) -> str:
        """One line for humans: "ZeRO-3 + offload(optimizer) | bf16 | accumulate 2"."""
        s = self.sharding
        parts = [f"ZeRO-{s.stage}"]
        offload = [n for n, on in (("optimizer", s.offload_optimizer), ("params", s.offload_params)) if on]
        if offload:
            parts[0] += f" + offload({', '.join(offload)})"
        parts.append(self.amp.dtype if self.amp.enable else "fp32")
        if self.uses_pipeline:
            parts.append(
                f"pipeline {self.pipeline.stages} stages x {self.pipeline.accumulate_steps} micro-batches"
            )
        elif self.gradient_merge.k_steps > 1:
            parts.append(f"accumulate {self.gradient_merge.k_steps}")
        if self.recompute.enable:
            parts.append("recompute")
        degrees = (
            ("TP", self.tensor_parallel.degree),
            ("SP", self.sequence_parallel.degree),
            ("EP", self.expert_parallel.degree),
        )
        parts.extend(f"{name} {degree}" for name, degree in degrees if degree > 1)
        return " | ".join(parts)

    def for_host_only(self) -> Strategy:
        """This strategy for a machine without an accelerator: offload dropped.

        Offloading moves states from device memory to host memory; when the device *is* the host
        there is nowhere to move them, and DeepSpeed's offload path only adds a host copy of the
        fp32 partition and per-group gradient buffers (a higher peak: benchmarks/memory.py).
        ZeRO-3 without offload is what such a run should get."""
        s = self.sharding
        if not (s.offload_optimizer or s.offload_params):
            return self
        return dataclasses.replace(
            self, sharding=dataclasses.replace(s, offload_optimizer=False, offload_params=False)
        )

    @property
    def uses_pipeline(self) -> bool:
        """True when the model runs on DeepSpeed's pipeline engine."""
        return self.pipeline.stages > 1

    @property
    def partitions_parameters(self) -> bool:
        """True when ZeRO-3 partitions the parameters (stage 3, never under the pipeline)."""
        return self.sharding.stage == 3 and not self.uses_pipeline

    @property
    def model_parallel_degree(self) -> int:
        """Ranks that share one data-parallel replica's batch: tensor x sequence parallel."""
        return self.tensor_parallel.degree * self.sequence_parallel.degree

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.pipeline.accumulate_steps if self.uses_pipeline else self.gradient_merge.k_steps

    def validate(self) -> None:
        """Reject combinations that cannot run, naming what to write instead."""
        s = self.sharding
        if s.stage not in (0, 1, 2, 3):
            raise ConfigError(f"strategy.sharding.stage={s.stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        if s.offload_params and s.stage != 3:
            raise ConfigError(
                f"strategy.sharding.offload_params needs ZeRO stage 3 (got stage {s.stage}); "
                "set strategy.sharding.stage=3 or offload_params=false"
            )
        if s.offload_optimizer and s.stage == 0:
            raise ConfigError(
                "strategy.sharding.offload_optimizer needs ZeRO stage 1, 2 or 3 (got stage 0); "
                "set strategy.sharding.stage>=1 or offload_optimizer=false"
            )
        bucket = s.allgather_bucket_size
        if s.stage in (1, 2) and bucket not in (None, "auto") and int(bucket) % 2:
            raise ConfigError(
                f"strategy.sharding.allgather_bucket_size={bucket}: ZeRO-1/2 need an even size "
                f"(DeepSpeed aligns it); use {int(bucket) + 1}, or auto"
            )
        if s.init not in ("auto", "whole", "partitioned"):
            raise ConfigError(f"strategy.sharding.init={s.init!r}; use auto, whole or partitioned")
        if self.amp.dtype not in ("bf16", "fp16"):
            raise ConfigError(f"strategy.amp.dtype={self.amp.dtype!r} is not supported; use bf16 or fp16")
        if self.gradient_merge.k_steps < 1:
            raise ConfigError(f"strategy.gradient_merge.k_steps={self.gradient_merge.k_steps} must be >= 1")
        p = self.pipeline
        if p.stages < 1 or p.accumulate_steps < 1:
            raise ConfigError("strategy.pipeline.stages and accumulate_steps must be >= 1")
        if self.uses_pipeline and s.stage >= 2:
            raise ConfigError(
                f"pipeline parallelism (strategy.pipeline.stages={p.stages}) cannot run with ZeRO stage "
                f"{s.stage}: DeepSpeed's pipeline engine supports ZeRO 0 and 1 only; use +strategy=pipeline "
                "(stage 0) or strategy.sharding.stage=1"
            )
        self._validate_degrees()
        if self.uses_pipeline and self.gradient_merge.k_steps != 1:
            raise ConfigError(
                "with a pipeline, accumulate with strategy.pipeline.accumulate_steps, "
                "not strategy.gradient_merge.k_steps"
            )

    def _validate_degrees(self) -> None:
        tp, sp, ep = self.tensor_parallel, self.sequence_parallel, self.expert_parallel
        for name, degree in (
            ("tensor_parallel", tp.degree),
            ("sequence_parallel", sp.degree),
            ("expert_parallel", ep.degree),
        ):
            if not isinstance(degree, int) or degree < 1:
                raise ConfigError(f"strategy.{name}.degree={degree!r} must be a whole number >= 1")
        parallel = [
            n for n, d in (("tensor", tp.degree), ("sequence", sp.degree), ("expert", ep.degree)) if d > 1
        ]
        if self.uses_pipeline and parallel:
            raise ConfigError(
                f"{' and '.join(parallel)} parallelism cannot run with the pipeline "
                f"(strategy.pipeline.stages={self.pipeline.stages}): DeepSpeed's pipeline engine takes neither "
                "AutoTP, Ulysses nor AutoEP; use one of them or the pipeline"
            )
        if tp.degree > 1 and sp.degree > 1:
            raise ConfigError(
                "tensor and sequence parallelism together are not supported (DeepSpeed 0.19's AutoTP and "
                "Ulysses build separate groups); use strategy.tensor_parallel.degree or sequence_parallel.degree"
            )
        if sp.degree > 1 and ep.degree > 1:
            raise ConfigError(
                "sequence and expert parallelism together are not supported by DeepSpeed 0.19's AutoEP; "
                "use one of them"
            )
        if ep.degree > 1 and self.sharding.stage == 0 and self.gradient_clip.max_norm > 0:
            raise ConfigError(  # measured: it clips by the mean of the ranks' norms, not the global one
                "expert parallelism with gradient clipping needs ZeRO stage 1-3: DeepSpeed 0.19's ZeRO-0 clips "
                "by a norm that misses the other ranks' experts; set strategy.sharding.stage >= 1"
            )
        if tp.degree > 1 and ep.degree > 1:  # measured: AutoEP raises on the TP groups handed as mpu
            raise ConfigError(
                "tensor and expert parallelism together are not supported (DeepSpeed 0.19's AutoEP does not "
                "take tensor-parallel groups yet); use strategy.tensor_parallel.degree or expert_parallel.degree"
            )
        for pattern, style in (tp.plan or {}).items():
            parse_tp_style(f"strategy.tensor_parallel.plan[{pattern!r}]", style)


TP_STYLES = ("column", "row", "replicate")


def parse_tp_style(where: str, style: str) -> tuple[str, int]:
    """A tensor-parallel plan's style as (kind, fused parts): "column" -> ("column", 1),
    "column:3" -> ("column", 3); a one-line error for anything else."""
    kind, _, parts = str(style).partition(":")
    kind = {"colwise": "column", "rowwise": "row"}.get(kind, kind)  # Hugging Face's spelling
    ok = kind in TP_STYLES and (not parts or (parts.isdigit() and int(parts) >= 1 and kind == "column"))
    if not ok:
        raise ConfigError(
            f"{where}={style!r} is not a tensor-parallel style; use column, row, replicate, or column:K "
            "for a fused projection of K equal parts (e.g. column:3 for q, k, v in one linear)"
        )
    return kind, int(parts or 1)


def plan_regex(module_pattern: str, params: str = "weight") -> str:
    """A tensor-parallel plan's module-name pattern (`*` matches one name part) as the regex of
    its modules' parameter names (`params`: the parameter names, a regex alternative)."""
    parts = (r"[^.]+" if part == "*" else re.escape(part) for part in module_pattern.split("."))
    return r"^(.*\.)?" + r"\.".join(parts) + r"\.(?:" + params + r")$"


def _section_from_dict(name: str, cls: type, data: dict[str, Any]) -> Any:
    valid = [f.name for f in fields(cls)]
    unknown = [k for k in data if k not in valid]
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in strategy.{name}; valid keys: {valid}")
    return cls(**data)


def compute_dtype_name(strategy: Strategy) -> str:
    """Name of the dtype the model computes in under this strategy: float32, bfloat16 or float16."""
    if not strategy.amp.enable:
        return "float32"
    return "bfloat16" if strategy.amp.dtype == "bf16" else "float16"
