"""`to_static` / `DistModel` (Paddle's auto-parallel dynamic-to-static API) and `shard_dataloader`.

    dm = to_static(model, loader, loss, optimizer, strategy)
    dm.train();   loss = dm(x, y)     # forward + backward + optimizer step
    dm.eval();    loss = dm(x, y)     # no grad, no step
    dm.predict(); out = dm(x)         # model outputs

Here "static" means "prepared on DeepSpeed's engine" (and `torch.compile`d when
`strategy.compile` is set). Unlike Paddle's, `to_static` never touches the user's loader.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from framework.data import loaders as data_lib
from framework.data.device_loader import DeviceLoader
from framework.data.stream_loader import StreamLoader
from framework.data.streams import is_stream
from framework.data.transfer import Copier
from framework.engine.engine import Engine
from framework.errors import ConfigError
from framework.plan.strategy import Strategy
from framework.process.context import ProcessContext


class DistModel:
    """A model prepared for distributed train / eval / predict; call it like the module.

    The default mode follows Paddle: loss and optimizer -> train, loss only -> eval,
    neither -> predict."""

    def __init__(
        self,
        layer: nn.Module,
        loader: Any = None,
        loss: Any = None,
        optimizer: Any = None,
        strategy: Strategy | dict[str, Any] | None = None,
        metrics: Any = None,
        input_spec: Any = None,
    ):
        self._engine = Engine(layer, loss, optimizer, metrics, strategy=strategy)
        self._batch_size = _global_batch_size(loader, self._engine)
        if (
            isinstance(loader, DeviceLoader)
            and isinstance(loader.loader, StreamLoader)
            and loader.agree is None
        ):
            loader.agree = self._engine.process.all_ranks  # the ranks end a stream's pass together
        self._input_spec = input_spec
        self._mode: str | None = None
        if loss is not None and optimizer is not None:
            self.train()
        elif loss is not None:
            self.eval()
        elif optimizer is None:
            self.predict()

    @property
    def engine(self) -> Engine:
        """The Engine doing the work."""
        return self._engine

    @property
    def network(self) -> nn.Module:
        """The wrapped module."""
        return self._engine.module

    def _set_mode(self, mode: str) -> None:
        self._engine.prepare(mode, self._batch_size)
        self._mode = mode

    def train(self) -> DistModel:
        """Switch to training: each call does forward, backward and an optimizer step."""
        self._set_mode("train")
        return self

    def eval(self) -> DistModel:
        """Switch to evaluation: each call returns the loss, without gradients or steps."""
        self._set_mode("eval")
        return self

    def predict(self) -> DistModel:
        """Switch to prediction: each call returns the model outputs."""
        self._set_mode("predict")
        return self

    def __call__(self, *args: Any) -> Any:
        """Run one step of the current mode on `args` (inputs..., labels for train/eval)."""
        if self._mode is None:
            raise ConfigError(
                "DistModel has no mode yet: call dm.train(), dm.eval() or dm.predict() before calling it"
            )
        batch: Any = args if len(args) > 1 else args[0]
        logs = self._engine.run(batch, mode=self._mode)
        if self._mode == "predict":
            return logs["outputs"]
        loss = logs["loss"]
        return torch.tensor(loss) if loss is not None else None

    def state_dict(self, mode: str = "all") -> dict[str, Any]:
        """ "param": full model weights (gathered under ZeRO-3, one module at a time, on every
        rank); "opt": this rank's optimizer state (DeepSpeed's, partitioned under ZeRO); "all":
        {"model": ..., "optimizer": ...}. Collective."""
        if mode not in ("all", "param", "opt"):
            raise ValueError(f"unknown state_dict mode {mode!r}; use 'all', 'param' or 'opt'")
        runtime = self._engine.runtime
        params = runtime.full_state_dict(on_every_rank=True) if mode in ("all", "param") else None
        opt = runtime.optimizer_state_dict() if mode in ("all", "opt") else None
        if mode == "param":
            return params  # type: ignore[return-value]
        if mode == "opt":
            return opt  # type: ignore[return-value]
        return {"model": params, "optimizer": opt}

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict()` returned (any mode)."""
        if "model" in state_dict or "optimizer" in state_dict:
            params, opt = state_dict.get("model"), state_dict.get("optimizer")
        elif any(isinstance(v, torch.Tensor) for v in state_dict.values()):
            params, opt = state_dict, None
        else:
            params, opt = None, state_dict
        if params is not None:
            self._engine.runtime.load_full_state_dict(params)
        if opt:
            self._engine.runtime.load_optimizer_state_dict(opt)


def _global_batch_size(loader: Any, engine: Engine) -> int | None:
    if loader is None:
        return None
    size = getattr(loader, "global_batch_size", None)
    if size:
        return int(size)
    per_loader = getattr(loader, "batch_size", None)
    return int(per_loader) if per_loader else None


def to_static(
    layer: nn.Module,
    loader: Any = None,
    loss: Any = None,
    optimizer: Any = None,
    strategy: Strategy | dict[str, Any] | None = None,
    metrics: Any = None,
    input_spec: Any = None,
) -> DistModel:
    """Prepare `layer` for distributed execution and return a `DistModel`.

    `loader` only tells the global batch size (its `global_batch_size`, else its `batch_size`);
    it is never iterated, so the data order the user sees is untouched."""
    return DistModel(layer, loader, loss, optimizer, strategy, metrics, input_spec)


def shard_dataloader(
    loader: DataLoader, engine: Engine | None = None, seed: int = 0, epochs: int = 1, prefetch: int = 2
) -> DeviceLoader:
    """Turn an ordinary `DataLoader` into this rank's share of it, batches on the device.

    Its `batch_size` is read as the global batch (split over data-parallel ranks); a shuffling
    loader becomes a seeded distributed shuffle, a sequential one stays in order; the dataset,
    collate_fn, num_workers and drop_last are kept. A loader of iterable data becomes this rank's
    share of the stream (`framework.data.streams`); its ranks end a pass together once an engine
    (or `to_static`) knows them."""
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        raise TypeError("shard_dataloader needs a torch DataLoader built with batch_size=...")
    process = ProcessContext.from_launcher() if engine is None else None  # no group needed to deal shares
    dp_size = engine.runtime.dp_size if engine is not None else process.world_size  # type: ignore[union-attr]
    dp_rank = engine.runtime.dp_rank if engine is not None else process.rank  # type: ignore[union-attr]
    if loader.batch_size % dp_size:
        raise ConfigError(
            f"the loader's batch_size {loader.batch_size} does not divide over {dp_size} data-parallel ranks; "
            f"use a multiple of {dp_size}"
        )
    shuffle = isinstance(loader.sampler, RandomSampler)
    per_rank = loader.batch_size // dp_size
    transfer = engine.transfer if engine is not None else Copier(process.device)  # type: ignore[union-attr]
    if is_stream(loader.dataset):
        stream = data_lib.stream_loader(
            loader.dataset, per_rank, dp_size, dp_rank, 0, seed, loader.collate_fn, loader.num_workers
        )
        agree = engine.process.all_ranks if engine is not None else None
        return DeviceLoader(stream, transfer, epochs, None, prefetch, loader.batch_size, agree=agree)
    sharded = data_lib.train_loader(
        loader.dataset,
        per_rank,
        dp_size,
        dp_rank,
        shuffle,
        seed,
        loader.drop_last,
        loader.collate_fn,
        loader.num_workers,
    )
    return DeviceLoader(sharded, transfer, epochs, None, prefetch, loader.batch_size)


__all__ = ["DistModel", "shard_dataloader", "to_static"]
