"""What a runtime's DeepSpeed engine holds, in and out: DeepSpeed's own checkpoint files of a rank,
the optimizer's state and the complete weights of the model (gathered from ZeRO partitions, or
loaded into them).
`framework.backend.runtime.Runtime` is one; nothing else touches DeepSpeed's engine.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.backend import checkpoint_files, expert_parallel, weights
from framework.backend.topology import Topology
from framework.integrations import peft


class RuntimeState(Topology):
    """The state side of `Runtime` (see the module doc): what its DeepSpeed engine holds."""

    deepspeed_engine: Any
    module: nn.Module | None
    config: dict[str, Any] | None
    compute_dtype: torch.dtype

    @property
    def ready(self) -> bool:
        """True once `initialize` ran."""
        return self.deepspeed_engine is not None

    @property
    def optimizer(self) -> Any:
        """DeepSpeed's (wrapped) optimizer, or None."""
        return getattr(self.deepspeed_engine, "optimizer", None)

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, ckpt_dir: str, tag: str) -> None:
        """DeepSpeed's own files of this rank (weights, optimizer, scheduler) under `ckpt_dir/tag`;
        of an adapted model, only what trains (the frozen base is rebuilt from where it came)."""
        self.deepspeed_engine.save_checkpoint(
            ckpt_dir, tag=tag, save_latest=False, exclude_frozen_parameters=self.adapted
        )

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> Any:
        """Load what `save_checkpoint` wrote; returns DeepSpeed's load path (None: nothing loaded)."""
        path, _ = self.deepspeed_engine.load_checkpoint(
            ckpt_dir, tag=tag, load_module_strict=not self.adapted
        )
        expert_parallel.unshare_optimizer_steps(getattr(self.optimizer, "optimizer", None))
        staged = Path(ckpt_dir) / tag / checkpoint_files.STATE_NAMES  # a conversion of SGD's states
        if path is not None and staged.is_file():
            checkpoint_files.restore_state_names(self.optimizer.optimizer, json.loads(staged.read_text()))
        return path

    @property
    def adapted(self) -> bool:
        """True for a model wrapped with adapters (`peft`): only they train and are checkpointed."""
        return peft.is_adapted(self.module)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (DeepSpeed's, partitioned under ZeRO)."""
        return self.optimizer.state_dict() if self.optimizer is not None else {}

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `optimizer_state_dict` gave on this rank. DeepSpeed's ZeRO / bf16 optimizers take
        one state dict per data-parallel rank; the fp32 master is rebuilt from the module weights."""
        optimizer = self.optimizer
        params = list(inspect.signature(optimizer.load_state_dict).parameters)
        if params and params[0] == "state_dict_list":
            optimizer.load_state_dict([state] * self.dp_size, load_from_fp32_weights=False)
        else:
            optimizer.load_state_dict(state)

    def _is_zero3(self) -> bool:
        return self.strategy.partitions_parameters

    def full_state_dict(self, on_every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The module's complete weights as CPU tensors, on rank 0 ({} elsewhere unless
        `on_every_rank`). Collective. See `framework.backend.weights.consolidate`."""
        assert self.module is not None
        pipe = self.deepspeed_engine.module if self.strategy.uses_pipeline and self.ready else None
        master = self.optimizer is not None
        return weights.consolidate(
            self.module,
            self._is_zero3(),
            pipe,
            on_every_rank,
            master,
            weights.fp32_masters(self.optimizer),
            self._process,
        )

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load complete weights into the module (every rank passes the same dict; under ZeRO-3
        rank 0's are used) and refresh DeepSpeed's fp32 master copy so the next optimizer step
        starts from them."""
        assert self.module is not None
        weights.load_whole(self.module, self._is_zero3(), state, self.mesh.rank)
        if hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()
