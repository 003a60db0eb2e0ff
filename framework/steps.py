"""Step flavours and the batch iterator a step consumes.

* batch step      ``step(engine, batch)``: the default (`loss(model(*inputs), labels)`), or a
                  model's ``training_step(batch)`` / ``validation_step`` / ``predict_step``.
* iterator step   any step with a parameter named ``dataloader_iter``: it pulls 0, 1 or many
                  batches per call from a `BatchIterator`, which counts every fetch (progress,
                  logs, exact resume) and hands out batches already on the device, prefetched
                  in the background.

A step returns a loss tensor (the framework does backward + optimizer step) or a dict of
metrics (the step drove `engine.backward` / `engine.step` itself), or None (nothing to log).
"""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from framework.data import batch_size_of

ITERATOR_ARG = "dataloader_iter"


def takes_iterator(fn: Callable[..., Any]) -> bool:
    """True when `fn` is an iterator-consuming step (has a `dataloader_iter` parameter)."""
    try:
        return ITERATOR_ARG in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def bind_step(step_fn: Callable[..., Any]) -> Callable[[Any, Iterator[Any]], Any]:
    """`step_fn` as one call on an iterator of batches, its flavour decided once: an iterator
    step gets the iterator, a batch step the iterator's next batch."""
    if takes_iterator(step_fn):
        return step_fn
    return lambda engine, batches: step_fn(engine, next(batches))


def resolve_step(
    user_step: Callable[..., Any] | None, module: torch.nn.Module, method: str
) -> Callable | None:
    """The step to use: an explicit one, else the model's `method` (training_step, validation_step,
    predict_step), else None
    (the framework's default batch step). A model method gets the engine as first argument like
    a free function does, so both are called as `step(engine, batch_or_iter)`."""
    if user_step is not None:
        return user_step
    bound = getattr(module, method, None)
    if callable(bound):
        params = inspect.signature(bound).parameters
        if ITERATOR_ARG in params:
            return lambda engine, dataloader_iter: bound(dataloader_iter)
        first = next(iter(params), None)
        if first == "engine":
            return bound
        return lambda engine, batch: bound(batch)
    return None


_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """Pull batches from `source` in a background thread, `depth` ahead, moved with `transfer`.

    Each queued item carries the value of `snapshot()` taken right after that batch was pulled,
    so the consumer knows the loader position that matches what it has really consumed.
    """

    def __init__(
        self,
        source: Iterator[Any],
        transfer: Callable[[Any], Any],
        depth: int = 2,
        snapshot: Callable[[], Any] | None = None,
    ):
        self._source, self._transfer, self._snapshot = source, transfer, snapshot
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._depth = depth
        self.last_snapshot: Any = None
        if depth > 0:
            self._thread = threading.Thread(target=self._fill, name="hydraspeed-prefetch", daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        try:
            for batch in self._source:
                item = (self._transfer(batch), self._snapshot() if self._snapshot else None)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._put_final(_END)
        except BaseException as exc:  # re-raised in the consumer's thread
            self._put_final(_Failure(exc))

    def _put_final(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._thread is None:  # depth 0: synchronous
            batch = next(self._source)
            self.last_snapshot = self._snapshot() if self._snapshot else None
            return self._transfer(batch)
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # later next() calls keep raising StopIteration
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.exc
        batch, self.last_snapshot = item
        return batch

    def close(self) -> None:
        """Stop the background thread (batches already pulled are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class BatchIterator:
    """The iterator a step consumes: counts each batch fetched and the samples it holds.

    `on_fetch(batch)` runs for every batch handed out (the engine advances its counters there),
    and `limit` caps the number of batches for this epoch (StopIteration after it).
    """

    def __init__(self, source: Iterator[Any], on_fetch: Callable[[Any], None], limit: int | None = None):
        self._source, self._on_fetch, self._limit = source, on_fetch, limit
        self.fetched = 0

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Any:
        if self._limit is not None and self.fetched >= self._limit:
            raise StopIteration
        batch = next(self._source)
        self.fetched += 1
        self._on_fetch(batch)
        return batch

    @staticmethod
    def samples_in(batch: Any) -> int:
        """Number of samples in one batch."""
        return batch_size_of(batch)
