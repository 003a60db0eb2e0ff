"""The DeepSpeed runtime of one Engine: the one owner of the DeepSpeed engine (its topology: the
process context, the mesh and the batch layout, in `framework.backend.topology`).

It gives `deepspeed.zero.Init` for partitioned construction, calls
`deepspeed.initialize` (the ZeRO or pipeline engine), and does everything that touches DeepSpeed's
engine afterwards (forward, backward, step, boundaries, lr / grad norm / loss scale, pipeline
batches, state dicts). Nothing outside this module holds DeepSpeed's engine.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from framework.backend import (
    deepspeed_globals,
    expert_parallel,
    generation,
    parallel,
    zero3_trace,
)
from framework.backend import pipeline as pipeline_lib
from framework.backend import recompute as recompute_lib
from framework.backend.ds_config import deepspeed_config, zero_init_config
from framework.backend.placement import offload_optimizer
from framework.backend.runtime_state import RuntimeState
from framework.data.transfer import Copier
from framework.errors import ConfigError
from framework.integrations import peft
from framework.plan.cost import largest_block, param_counts
from framework.plan.run_plan import scheduler_for
from framework.plan.strategy import Strategy, compute_dtype_name
from framework.process import watchdog
from framework.process.context import ProcessContext


class Runtime(RuntimeState):
    """DeepSpeed for one model under one `Strategy` (see the module doc); where it runs and how
    its batch splits come from `Topology`, its checkpoints and whole weights from `RuntimeState`."""

    def __init__(self, strategy: Strategy, process: ProcessContext | None = None):
        super().__init__(strategy, process)
        self.config: dict[str, Any] | None = None  # the dict DeepSpeed received
        self.deepspeed_engine: Any = None
        self.module: nn.Module | None = None  # the user's model
        self.parameters = 0  # the model's, counted whole before DeepSpeed splits it
        self.trainable_parameters = 0  # of them, those with requires_grad (what the optimizer gets)
        self.load_universal = False  # the checkpoint to resume was written with another world size
        self.compute_dtype: torch.dtype = getattr(torch, compute_dtype_name(self.strategy))
        self.grad_norm_wanted = False  # ZeRO-0: compute the norm at the next step (costs a few %)
        self._last_grad_norm: torch.Tensor | None = None
        self._copier: Copier | None = None
        self._open_backward = False  # `backward` ran since the last `step`
        self.backward_calls = 0  # backward passes so far (a step call with none trained nothing)
        self.timer: Any = None  # a throughput.PhaseTimer while a fit measures its steps

    # ------------------------------------------------------------------ building
    def init_context(self) -> contextlib.AbstractContextManager:
        """Context to construct a model in: `deepspeed.zero.Init` under ZeRO-3 (parameters are born
        partitioned, never whole on one rank), nothing otherwise."""
        if not self.strategy.partitions_parameters:
            return contextlib.nullcontext()
        deepspeed = deepspeed_globals.load()

        self.start()
        return deepspeed.zero.Init(
            config_dict_or_path=zero_init_config(self.strategy, self.layout_for_init(), self.cuda)
        )

    def deepspeed_config_for(self, module: nn.Module) -> dict[str, Any]:
        """The config `initialize` gives DeepSpeed for `module` (what `+dry_run=true` prints)."""
        sizes = (*param_counts(module), self.load_universal, self.cuda, largest_block(module))
        plan = parallel.tp_plan_of(self.strategy, module)
        return deepspeed_config(self.strategy, self.layout_for_init(), *sizes, tp_plan=plan)

    def initialize(
        self, module: nn.Module, optimizer: Any = None, loss_fn: Callable[..., torch.Tensor] | None = None
    ) -> None:
        """Hand the model (and optimizer) to `deepspeed.initialize`, once. The learning-rate
        schedule comes with training's step budget (`schedule`), not here: a build for
        evaluation or loading must not freeze it."""
        deepspeed = deepspeed_globals.load()

        process = self.start()
        deepspeed_globals.quiet()
        parallel.check_model(self.strategy, self.mesh, module)
        self.module, self.parameters = module, param_counts(module)[0]
        self.trainable_parameters = sum(
            int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad
        )
        self.config = self.deepspeed_config_for(module)
        optimizer = offload_optimizer(self.strategy, optimizer, process)
        optimizer = expert_parallel.optimizer_with_expert_groups(self.strategy, optimizer)
        if process.is_main and peft.is_adapted(module):
            print(f"adapter: {peft.describe(module)}", flush=True)
        if self.strategy.recompute.enable and not self.strategy.uses_pipeline:
            recompute_lib.enable(module, say=process.is_main)
        if self.strategy.compile:
            module.compile()
        model: nn.Module = module
        if self.strategy.uses_pipeline:
            if loss_fn is None:
                raise ConfigError("pipeline parallelism needs a loss: the last stage computes it")
            model = pipeline_lib.build_pipeline_module(module, self.strategy, loss_fn)
        else:
            module.to(process.device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if optimizer is not None and not trainable:
            raise ConfigError(
                f"{type(module).__name__} has no trainable parameters: there is nothing for the optimizer to "
                "train (check the model config, or requires_grad)"
            )
        with watchdog.suspended():  # a first run may JIT-build DeepSpeed's ops
            self.deepspeed_engine, _, _, _ = deepspeed.initialize(
                args=types.SimpleNamespace(device_rank=process.device_index),  # the device we chose
                model=model,
                optimizer=optimizer,
                model_parameters=trainable if optimizer is None or callable(optimizer) else None,
                config=self.config,
                mpu=parallel.process_groups(self.mesh, module),
            )
        if self._is_zero3():
            zero3_trace.keep_release_plans_fresh(module, self.deepspeed_engine)
        alone = self.world_size == self.mesh.tp_size  # no rank to sum gradients with (TP ranks need none)
        if alone and self.strategy.sharding.stage == 0 and not self.strategy.uses_pipeline:
            # One data-parallel rank: DeepSpeed would still flatten and "all-reduce" every gradient
            # over a group of one each step (pure copies).
            self.deepspeed_engine.enable_backward_allreduce = self.strategy.amp.enable
        if self.compute_dtype != torch.float32:
            # model(x) with float32 inputs (a user's own tensors) computes in the model's dtype.
            module.register_forward_pre_hook(
                lambda _m, args, kwargs: self.transfer((args, kwargs)), with_kwargs=True
            )

    def schedule(self, factory: Callable[..., Any], total_steps: int) -> None:
        """(Re)build the learning-rate schedule over `total_steps` optimizer steps on DeepSpeed's
        optimizer (DeepSpeed steps it and saves it in checkpoints). A schedule built before the
        budget was known (a `load` of a checkpoint before `fit`) is continued at its step."""
        ds = self.deepspeed_engine
        old = ds.lr_scheduler
        new = scheduler_for(factory, total_steps)(ds.basic_optimizer)
        if old is not None and old is not new and getattr(old, "last_epoch", 0) > 0:
            new.last_epoch = old.last_epoch - 1
            new.step()  # the lr of the step the old schedule reached, under the new budget
        ds.lr_scheduler = new

    @property
    def copier(self) -> Copier:
        """Moves batches to this rank's device (floating tensors in the compute dtype); on CUDA
        from pinned memory on a side stream (see `framework.data.transfer`)."""
        if self._copier is None:
            cast = self.compute_dtype if self.compute_dtype != torch.float32 else None
            self._copier = Copier(self.device, cast)
        return self._copier

    def transfer(self, batch: Any) -> Any:
        """Move a batch to this rank's device now (floating tensors in the compute dtype)."""
        return self.copier(batch)

    # ------------------------------------------------------------------ running
    @property
    def forward(self) -> Any:
        """What runs the forward pass: DeepSpeed's engine once built (its hooks gather ZeRO-3
        parameters), else the plain module."""
        return self.deepspeed_engine if self.deepspeed_engine is not None else self.module

    def train(self, mode: bool = True) -> None:
        """Training (or evaluation) mode for dropout, norms and DeepSpeed's own bookkeeping."""
        target = self.forward
        if target is not None:
            target.train(mode)

    @property
    def training(self) -> bool:
        """True in training mode."""
        return bool(self.module is not None and self.module.training)

    # ------------------------------------------------------------------ optimisation
    def backward_and_step(self, loss: torch.Tensor) -> None:
        """Backward + step of one micro-batch; DeepSpeed applies the update at accumulation boundaries."""
        ds, timer = self.deepspeed_engine, self.timer
        start = timer.now() if timer is not None else None
        self.backward_calls += 1
        ds.backward(loss)
        middle = timer.now() if timer is not None else None
        if ds.is_gradient_accumulation_boundary():
            self._note_grad_norm()
        ds.step()
        if timer is not None:
            timer.add("backward", start, middle)
            timer.add("optimizer", middle, timer.now())

    def backward(self, loss: torch.Tensor) -> None:
        """A backward pass that `step` closes (any number of them before one step): each is a
        non-boundary micro-step, the loss used as given."""
        self.backward_calls += 1
        self.deepspeed_engine.set_gradient_accumulation_boundary(False)
        self.deepspeed_engine.backward(loss, scale_wrt_gas=False)
        self._open_backward = True

    def step(self) -> None:
        """Optimizer step after one or more `backward` calls. Closing an off-boundary accumulation
        differs by stage (DeepSpeed 0.19): ZeRO-0/1 reduce the `.grad`s explicitly; ZeRO-2 reduces
        only in a boundary backward (a zero-valued one marks it); ZeRO-3 needs nothing."""
        ds = self.deepspeed_engine
        ds.set_gradient_accumulation_boundary(True)
        stage = ds.zero_optimization_stage()
        if stage < 2:
            ds.allreduce_gradients()
        elif stage == 2:
            assert self.module is not None
            zero = sum((p * 0).sum() for p in self.module.parameters() if p.requires_grad)
            ds.backward(zero, scale_wrt_gas=False)
        self._note_grad_norm()
        ds.step()
        self._open_backward = False

    def discard_open_step(self) -> None:
        """Drop the gradients of `backward` calls no `step` closed (a manual step cut short by
        the end of an epoch), so the next optimizer step starts from none."""
        if self._open_backward:
            self.optimizer.zero_grad(set_to_none=True)  # ZeRO-3 also restarts its accumulation
            assert self.module is not None
            for p in self.module.parameters():
                p.grad = None
            self._open_backward = False

    def _note_grad_norm(self) -> None:
        if not self.grad_norm_wanted or self.deepspeed_engine.zero_optimization_stage() != 0:
            return
        assert self.module is not None
        self._last_grad_norm = parallel.grad_norm(list(self.module.parameters()), self.mesh, self.device)

    def at_step_boundary(self) -> bool:
        """True between optimizer steps (no gradient accumulation half done): a safe point to checkpoint."""
        ds = self.deepspeed_engine
        if ds is None or self.strategy.uses_pipeline:
            return True
        return ds.micro_steps % ds.gradient_accumulation_steps() == 0

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 overflow steps included, as DeepSpeed counts)."""
        return int(self.deepspeed_engine.global_steps) if self.deepspeed_engine is not None else 0

    micro_steps = property(
        lambda self: int(getattr(self.deepspeed_engine, "micro_steps", 0)), doc="Backwards."
    )

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the fp16 loss scaler skipped (an overflow)."""
        return int(self.deepspeed_engine.skipped_steps) if self.deepspeed_engine is not None else 0

    @property
    def optimizer_name(self) -> str:
        """The class name of the optimizer inside DeepSpeed's wrappers ("" without one)."""
        opt = self.optimizer
        while opt is not None and not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return type(opt).__name__ if opt is not None else ""

    @property
    def lr(self) -> float:
        """Current learning rate of the first parameter group."""
        groups = getattr(self.optimizer, "param_groups", None) or []
        return float(groups[0]["lr"]) if groups else 0.0

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm of the last optimizer step (ZeRO-0: of the last step that had
        `grad_norm_wanted` set; DeepSpeed reports it for the other stages)."""
        norm = self.deepspeed_engine.get_global_grad_norm() if self.deepspeed_engine is not None else None
        if norm is None:
            norm = self._last_grad_norm
        if norm is None:
            return None
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    @property
    def loss_scale(self) -> float:
        """Current fp16 loss scale (1.0 without fp16)."""
        opt = self.optimizer
        return float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 1.0)) or 1.0)

    # ------------------------------------------------------------------ pipeline
    def train_batch(self, batches: Iterator[Any]) -> torch.Tensor:
        """One pipeline optimizer step over `accumulate_steps` micro-batches from `batches`."""
        return pipeline_lib.train_batch(self.deepspeed_engine, batches)

    def eval_batch(self, batches: Iterator[Any]) -> torch.Tensor:
        """The pipeline's mean loss over one round of micro-batches, without gradients."""
        return pipeline_lib.eval_batch(self.deepspeed_engine, batches)

    def frozen(self, module: nn.Module) -> Any:
        """A frozen model (a reference, never trained) laid out as the trained one: under ZeRO-3 its
        own DeepSpeed engine without an optimizer (partitioned over the ranks, gathered layer by
        layer in its forward pass); otherwise the module on this rank's device. Call it after
        `initialize` (the trained model's config is reused, its optimizer left out)."""
        deepspeed = deepspeed_globals.load()

        module.requires_grad_(False).eval()
        if not self._is_zero3():
            return module.to(self.device, dtype=self.compute_dtype)
        config = {k: v for k, v in (self.config or {}).items() if k not in ("optimizer", "scheduler")}
        with watchdog.suspended():
            engine, _, _, _ = deepspeed.initialize(
                args=types.SimpleNamespace(device_rank=self.process.device_index),
                model=module,
                config=config,
                mpu=parallel.process_groups(self.mesh, module),
            )
        zero3_trace.keep_release_plans_fresh(module, engine)
        engine.eval()
        return engine

    @contextlib.contextmanager
    def generating(self) -> Iterator[nn.Module]:
        """The trained module in evaluation mode with all its weights on this rank, for a rollout
        (`framework.backend.generation`: under ZeRO-3 gathered once, not per new token); the
        mode it had, and its partitions, come back when the block ends. Collective under ZeRO-3:
        every rank enters it."""
        assert self.module is not None
        was_training = self.training
        self.train(False)
        try:
            with generation.whole(self.module, self.deepspeed_engine, self._is_zero3()) as module:
                yield module
        finally:
            self.train(was_training)
