"""What an autotune search is made of: a `Layout` (the knobs of a `Strategy` a tuner may turn),
a `Trial` (one layout and what became of it) and the `ModelFacts` it is sized by
(`framework.plan.tune` searches over them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from framework.plan.strategy import Strategy

# The knobs a space may name (`autotune.space`), in the order the table shows them.
KNOBS = ("stage", "offload", "micro_batch", "recompute", "tensor_parallel")
TIE = 0.03  # samples/s within 3 % of the fastest: as fast (the simpler layout wins)
GB = 2**30  # memory in this module's reports is in GiB, written GB as DeepSpeed's estimators do
ACCUMULATION = (1, 2, 4)  # micro-batch tried: the whole per-rank batch, its half and its quarter


@dataclass(frozen=True)
class Layout:
    """One point of the search: the knobs of a `Strategy` a tuner may turn."""

    stage: int = 0
    offload: bool = False
    accumulation: int = 1
    recompute: bool = False
    tensor_parallel: int = 1

    @classmethod
    def of(cls, strategy: Strategy) -> Layout:
        """The layout `strategy` has now."""
        return cls(
            strategy.sharding.stage,
            strategy.sharding.offload_optimizer,
            strategy.gradient_merge.k_steps,
            strategy.recompute.enable,
            strategy.tensor_parallel.degree,
        )

    def apply(self, strategy: Strategy) -> Strategy:
        """`strategy` with this layout's knobs (everything else as it was)."""
        return dataclasses.replace(
            strategy,
            sharding=dataclasses.replace(strategy.sharding, stage=self.stage, offload_optimizer=self.offload),
            gradient_merge=dataclasses.replace(strategy.gradient_merge, k_steps=self.accumulation),
            recompute=dataclasses.replace(strategy.recompute, enable=self.recompute),
            tensor_parallel=dataclasses.replace(strategy.tensor_parallel, degree=self.tensor_parallel),
        )

    def overrides(self) -> list[str]:
        """The command-line overrides that pin this layout (so a next run skips the search)."""
        return [
            f"strategy.sharding.stage={self.stage}",
            f"strategy.sharding.offload_optimizer={str(self.offload).lower()}",
            f"strategy.gradient_merge.k_steps={self.accumulation}",
            f"strategy.recompute.enable={str(self.recompute).lower()}",
            f"strategy.tensor_parallel.degree={self.tensor_parallel}",
        ]

    def describe(self, micro_batch: int | None = None) -> str:
        """'ZeRO-2 + offload | micro 8 x 2 | recompute | TP 2' (the parts that are on)."""
        parts = [f"ZeRO-{self.stage}" + (" + offload" if self.offload else "")]
        if micro_batch is not None:
            parts.append(f"micro {micro_batch} x {self.accumulation}")
        elif self.accumulation > 1:
            parts.append(f"accumulate {self.accumulation}")
        if self.recompute:
            parts.append("recompute")
        if self.tensor_parallel > 1:
            parts.append(f"TP {self.tensor_parallel}")
        return " | ".join(parts)

    @property
    def simplicity(self) -> tuple[int, ...]:
        """Sorts simpler layouts first: no model parallelism, no offload, no recompute, a lower
        stage, fewer accumulation steps."""
        return (self.tensor_parallel, int(self.offload), int(self.recompute), self.stage, self.accumulation)


def needs_more(a: Layout, b: Layout) -> bool:
    """True when `a` holds at least what `b` holds on a rank, knob by knob (a lower or equal stage,
    no more offload, no more accumulation, no more recompute, no more tensor parallelism): if `b`
    did not fit, neither does `a`."""
    return (
        a.stage <= b.stage
        and a.offload <= b.offload
        and a.accumulation <= b.accumulation
        and a.recompute <= b.recompute
        and a.tensor_parallel <= b.tensor_parallel
    )


@dataclass(frozen=True)
class ModelFacts:
    """What the search needs to know of the model (`framework.backend.estimate.model_facts`)."""

    parameters: int
    largest_parameter: int
    optimizer_bytes_per_param: int = 8
    tp_split: int = 0  # parameters tensor parallelism splits
    ep_split: int = 0  # parameters expert parallelism splits
    recomputable: bool = False  # it has blocks to recompute
    tp_degrees: tuple[int, ...] = (1,)  # the tensor-parallel degrees its plan and heads allow


@dataclass
class Trial:
    """One layout of a search and what became of it. `status`: pending, ok, over budget,
    failed: <why>, pruned: <why>, skipped: <why>, on paper."""

    layout: Layout
    micro_batch: int
    estimated_gb: float
    status: str = "pending"
    peak_gb: float | None = None
    samples_per_s: float | None = None
    fits: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.layout.describe(self.micro_batch)

    def row(self) -> dict[str, Any]:
        """This trial as `autotune.json` records it."""
        return {
            "layout": self.name,
            "overrides": self.layout.overrides(),
            "estimated_gb": round(self.estimated_gb, 4),
            "peak_gb": None if self.peak_gb is None else round(self.peak_gb, 4),
            "samples_per_s": None if self.samples_per_s is None else round(self.samples_per_s, 2),
            "fits": self.fits,
            "status": self.status,
            **self.extra,
        }
