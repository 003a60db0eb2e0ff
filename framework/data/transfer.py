"""Batches from host memory to the device.

On CUDA the copies run on a side stream from pinned (page-locked) memory, started by the
prefetch thread, so the copy of the next batch overlaps the compute of this one; the compute
stream waits on the copy's event before it uses the batch, and the batch's memory is recorded
on the compute stream so the allocator never reuses it early. Tensors already on the device (a
user's own inputs to `model(x)`) are cast on the compute stream that made them. On the CPU a batch
is only cast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from framework.data.outputs import map_tensors


def to_device(batch: Any, dev: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Move a batch (tensor / tuple / list / dict, nested) to `dev`; cast floating tensors if asked."""
    if isinstance(batch, torch.Tensor):
        if float_dtype is not None and batch.is_floating_point():
            return batch.to(dev, dtype=float_dtype, non_blocking=True)
        return batch.to(dev, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(b, dev, float_dtype) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, dev, float_dtype) for b in batch)
    if isinstance(batch, Mapping):  # dicts, Hugging Face's BatchEncoding
        return {k: to_device(v, dev, float_dtype) for k, v in batch.items()}
    return batch


class Copier:
    """`copy(batch)` (any thread) starts moving a batch to `device`; `ready(item)` (the compute
    thread) returns the batch once it may be used there."""

    def __init__(self, device: torch.device, float_dtype: torch.dtype | None = None):
        self.device, self.float_dtype = device, float_dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, batch: Any) -> Any:
        """The batch on its way to the device (with the event that marks its arrival on CUDA)."""
        if self.stream is None:
            return to_device(batch, self.device, self.float_dtype)
        pinned = map_tensors(self._stage, batch)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            moved = to_device(pinned, self.device, self.float_dtype)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _InFlight(moved, event)

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor already on the device is cast here, on the current stream that wrote it (on the
        copy stream the cast could read it before it is written); a host tensor gets pinned."""
        if t.is_cuda:
            return to_device(t, self.device, self.float_dtype)
        return t if t.is_pinned() else t.pin_memory()

    def ready(self, item: Any) -> Any:
        """The batch, usable on the current (compute) stream."""
        if not isinstance(item, _InFlight):
            return item
        current = torch.cuda.current_stream(self.device)
        current.wait_event(item.event)
        map_tensors(lambda t: t.record_stream(current) if t.is_cuda else None, item.batch)
        return item.batch

    def __call__(self, batch: Any) -> Any:
        """Copy and wait: a batch usable now (for callers outside the prefetcher)."""
        return self.ready(self.copy(batch))


class _InFlight:
    def __init__(self, batch: Any, event: Any):
        self.batch, self.event = batch, event
