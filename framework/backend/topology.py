"""Where a runtime runs and how its batch splits: the job's process context (made on first use
when none was given), the mesh of ranks under the strategy, and the batch layout.

The batch layout (global = micro x accumulation x data-parallel ranks) is fixed by the first
training call that names a global batch; evaluation and prediction only split their batch over
data-parallel ranks. `framework.backend.runtime.Runtime` builds DeepSpeed on top of it.
"""

from __future__ import annotations

import torch

from framework.backend import deepspeed_globals
from framework.backend.placement import for_this_machine
from framework.errors import ConfigError
from framework.plan.run_plan import BatchLayout, Mesh, batch_layout, mesh_of
from framework.plan.strategy import Strategy
from framework.process.allocator import tune_host_allocator
from framework.process.context import ProcessContext
from framework.process.environment import choose_accelerator, env_rank, env_world_size


class Topology:
    """The process context, mesh and batch layout of one runtime (see the module doc)."""

    def __init__(self, strategy: Strategy, process: ProcessContext | None = None):
        # The job's process context: given (the CLI makes one per job), else made by `start`.
        self._process: ProcessContext | None = process
        self.accelerator = process.accelerator if process is not None else choose_accelerator()
        self._owns_process = False
        self._joined: ProcessContext | None = None  # the context DeepSpeed was joined to
        self.strategy = for_this_machine(strategy, self.cuda)
        # Before the model is built (ZeRO 1/2 copy its weights into flat buffers and free them).
        tune_host_allocator(self.cuda, sharded=self.strategy.sharding.stage >= 1)
        self.layout: BatchLayout | None = None
        self._provisional = False  # the layout was made up to build DeepSpeed before any training call

    # ------------------------------------------------------------------ topology
    def start(self) -> ProcessContext:
        """The job's process context (made now, on this runtime's accelerator, when none was
        given), with DeepSpeed joined to its group; on a CPU, glibc's thresholds for this ZeRO
        stage (`framework.process.allocator`; a Hydra sweep's next job may use another stage)."""
        if self._process is None or not self._process.alive:
            self._process = ProcessContext.start(self.accelerator)
            self._owns_process = True
        if self._joined is not self._process:
            deepspeed_globals.join(self._process)
            self._joined = self._process
            tune_host_allocator(self.cuda, sharded=self.strategy.sharding.stage >= 1)
        return self._process

    @property
    def process(self) -> ProcessContext:
        """The job's process context (`start`ed on first use)."""
        return self.start()

    def close(self, sync: bool = True) -> None:
        """End the process context this runtime made (nothing for one it was given)."""
        if self._owns_process and self._process is not None:
            self._process.close(sync)

    @property
    def cuda(self) -> bool:
        """True when this runtime trains on CUDA devices."""
        return self.accelerator == "cuda"

    @property
    def world_size(self) -> int:
        """Processes in the job (as the launcher said, before the process group exists)."""
        return self._process.world_size if self._process is not None else env_world_size()

    @property
    def mesh(self) -> Mesh:
        """The job's ranks under this strategy (`framework.plan.mesh_of`)."""
        rank = self._process.rank if self._process is not None else env_rank()
        return mesh_of(self.strategy, self.world_size, rank)

    @property
    def device(self) -> torch.device:
        """The device this rank computes on (its process context's)."""
        return self.process.device

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: processes / pipeline stages."""
        return self.mesh.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas."""
        return self.mesh.dp_rank

    # ------------------------------------------------------------------ the batch layout
    def fix_layout(self, global_batch_size: int) -> BatchLayout:
        """The training layout for this global batch; the first call fixes it for good."""
        if self.layout is not None and not self._provisional:
            if global_batch_size != self.layout.global_batch_size:
                raise ConfigError(
                    f"this engine trains with a global batch of {self.layout.global_batch_size} (fixed by its "
                    f"first training call), not {global_batch_size}: keep the batch size, or use a new Engine"
                )
            return self.layout
        self.layout = batch_layout(self.strategy, global_batch_size, self.world_size)
        self._provisional = False
        return self.layout

    layout_fixed = property(
        lambda self: self.layout is not None and not self._provisional, doc="A training call fixed it."
    )

    def layout_for_init(self) -> BatchLayout:
        """The layout to build DeepSpeed's configs with now (the fixed one, or a provisional one)."""
        if self.layout is None:
            smallest = self.dp_size * self.strategy.accumulation_steps
            self.layout, self._provisional = batch_layout(self.strategy, smallest, self.world_size), True
        return self.layout

    def pipeline_eval_layout(self, global_batch_size: int) -> BatchLayout:
        """A pipeline's evaluation batch: as many micro-batches as training, each rank its share."""
        return batch_layout(self.strategy, global_batch_size, self.world_size)
