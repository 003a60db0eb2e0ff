"""Per-rank data: loaders, background prefetch to the device, and the iterator a step pulls from.

Training uses torchdata's `StatefulDataLoader` over a `DistributedSampler`, so a loader's
position (mid-epoch included) is part of a checkpoint. Evaluation gives every rank the same
number of batches (ZeRO-3 gathers parameters collectively: a rank with one batch more would
hang the others) and knows how many samples of its shard are unpadded, so padding never
counts in a metric.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from framework.data.stream_loader import StreamLoader, own_generator
from framework.data.streams import as_stream
from framework.errors import ConfigError
from framework.process.environment import cores_per_rank


class EvalShardSampler(Sampler[int]):
    """Rank `rank` takes items rank, rank+N, ...; shards are padded to equal length by repeating
    the first items, and `unpadded` says how many of this rank's items are not padding."""

    def __init__(self, dataset_len: int, num_replicas: int, rank: int):
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.per_rank = math.ceil(dataset_len / num_replicas) if dataset_len else 0
        self.unpadded = len(range(rank, dataset_len, num_replicas))

    def __iter__(self) -> Iterator[int]:
        real = list(range(self.rank, self.dataset_len, self.num_replicas))
        pad = [i % max(self.dataset_len, 1) for i in range(self.per_rank - len(real))]
        return iter(real + pad)

    def __len__(self) -> int:
        return self.per_rank


def dataset_len(dataset: Any) -> int:
    """Length of a map-style dataset, or a clear error for an unsized one."""
    if not isinstance(dataset, Sized):
        raise TypeError(
            f"{type(dataset).__name__} has no len(); pass a map-style Dataset or use "
            "Engine.dataloader_from_generator for an iterable source"
        )
    return len(dataset)


def train_loader(
    dataset: Dataset,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    collate_fn: Callable | None = None,
    num_workers: int = 0,
) -> StatefulDataLoader:
    """This rank's training loader: `micro_batch_size` samples per batch, its own shard.

    With `drop_last` (training's way) an epoch is cut the same on every layout: the shuffled
    order is cut to whole rounds of the ranks and batches to whole micro-batches, so an epoch
    holds the first `n // G * G` samples of its order in global batches of G, whatever the
    number of ranks (a sampler that padded by repeating samples gave 2 ranks one more step
    than 1). `drop_last=False` (a user's `DataLoader` kept as it is) pads shards to equal
    length by repeating samples, as `DistributedSampler` does.
    """
    n = dataset_len(dataset)
    if n // dp_size < micro_batch_size:
        raise ConfigError(  # a ValueError too
            f"the training set has {n} samples: too few for {dp_size} rank(s) x micro-batch {micro_batch_size}; "
            "use a smaller batch size"
        )
    sampler: DistributedSampler = DistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    # torchdata's loader calls torch.set_vital on each iterator, which torch has deprecated: a
    # warning on every run that no user can act on (torchdata's to mend, not ours or theirs).
    warnings.filterwarnings("ignore", message=".*'set_vital' is deprecated.*", category=UserWarning)
    return StatefulDataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
        generator=own_generator(seed),
    )


def stream_loader(
    data: Any,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    shuffle_window: int = 0,
    seed: int = 0,
    collate_fn: Callable | None = None,
    num_workers: int = 0,
    drop_last: bool = True,
    to_the_end: bool = False,
) -> StreamLoader:
    """This rank's loader of a stream (`framework.data.streams`): a `Stream` as it says, other
    iterable data with the shuffle window and seed given; `to_the_end`: every item of the rank's
    shards (evaluation), not a pass that ends at its first empty slot (training's order)."""
    stream = as_stream(data, shuffle_window, seed)
    return StreamLoader(
        stream, micro_batch_size, dp_size, dp_rank, num_workers, drop_last, collate_fn, to_the_end
    )


def eval_loader(
    dataset: Dataset,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    collate_fn: Callable | None = None,
    num_workers: int = 0,
) -> DataLoader:
    """This rank's evaluation loader; the first `loader.sampler.unpadded` samples are not padding."""
    sampler = EvalShardSampler(dataset_len(dataset), dp_size, dp_rank)
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        generator=own_generator(),
    )


def split_micro_batches(batch: Any, parts: int) -> list[Any]:
    """Split every tensor of a batch along dim 0 into `parts` equal micro-batches."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % parts:
            raise ConfigError(f"a batch of {batch.shape[0]} does not split into {parts} accumulation steps")
        return list(batch.chunk(parts))
    if isinstance(batch, (list, tuple)):
        columns = [split_micro_batches(b, parts) for b in batch]
        return [type(batch)(col[i] for col in columns) for i in range(parts)]
    if isinstance(batch, Mapping):
        split = {k: split_micro_batches(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(parts)]
    return [batch] * parts


_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


# Inline pulls a prefetcher times before it decides whether a thread would hide waits.
WATCH_PULLS = 8


class Prefetcher:
    """Pull batches from `source` in a background thread, `depth` ahead, moved with `transfer`.

    `transfer` is a function, or a `framework.data.transfer.Copier`: then the background thread only
    starts each copy (`copy`) and the consumer waits for it (`ready`), so on CUDA copies overlap
    compute. Yields (batch, snapshot) pairs: `snapshot()` is taken right after that batch was
    pulled, so the consumer knows the loader position that matches what it has really consumed.

    `background`: whether a thread pulls ahead. By default it does where it can run beside the
    step: when batches go to an accelerator (the step's kernels run there while the host pulls),
    or when this process has a CPU core to itself beyond the first (`cores_per_rank`). A CPU
    rank with one core pulls each batch when the step asks for it, as long as pulling is work
    for that core: a thread could only take turns with the step there (on 2 processes x 2 cores
    the turns cost ~0.7 ms of CPU per step). If pulling waits instead (on files, the network,
    loader worker processes: more than half of the first `WATCH_PULLS` pulls' time spent off
    the CPU), a thread takes over from then on and the waits overlap the step.
    """

    def __init__(
        self,
        source: Iterator[Any],
        transfer: Callable[[Any], Any],
        depth: int = 2,
        snapshot: Callable[[], Any] | None = None,
        background: bool | None = None,
    ):
        self._source, self._snapshot = source, snapshot
        self._transfer = getattr(transfer, "copy", transfer)
        self._ready = getattr(transfer, "ready", None)
        self._queue: queue.Queue = queue.Queue()
        # At most `depth` batches pulled and not yet handed out (the one being pulled included).
        self._slots = threading.Semaphore(max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: list[float] | None = None  # pulls so far, their wall and CPU seconds (inline)
        if depth > 0 and background is None and not _has_room_beside_the_step(transfer):
            self._watch = [0, 0.0, 0.0]
        elif depth > 0 and background is not False:
            self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._fill, name="hydraspeed-prefetch", daemon=True)
        self._thread.start()

    def _pull_watched(self) -> tuple[Any, Any]:
        """Pull inline; after `WATCH_PULLS` pulls, hand over to a thread if they mostly waited."""
        assert self._watch is not None
        wall, cpu = time.perf_counter(), time.thread_time()
        item = self._pull()
        watch = self._watch
        watch[0] += 1
        watch[1] += time.perf_counter() - wall
        watch[2] += time.thread_time() - cpu
        if watch[0] >= WATCH_PULLS:
            self._watch = None
            if watch[1] - watch[2] > watch[1] / 2:
                self._start()
        return item

    def _pull(self) -> tuple[Any, Any]:
        batch = next(self._source)
        return self._transfer(batch), self._snapshot() if self._snapshot else None

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=0.1):
                    continue
                try:
                    item: Any = self._pull()
                except StopIteration:
                    item = _END
                self._queue.put(item)
                if item is _END:
                    return
        except BaseException as exc:  # re-raised in the consumer's thread
            self._queue.put(_Failure(exc))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[Any, Any]:
        if self._thread is None:  # inline: depth 0, or no core for a thread
            item = self._pull() if self._watch is None else self._pull_watched()
        else:
            item = self._queue.get()
            if item is _END:
                self._queue.put(_END)  # later next() calls keep raising StopIteration
                raise StopIteration
            if isinstance(item, _Failure):
                raise item.exc
            self._slots.release()
        batch, snapshot = item
        return (self._ready(batch) if self._ready is not None else batch), snapshot

    def close(self) -> None:
        """Stop the background thread (batches already pulled are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _has_room_beside_the_step(transfer: Any) -> bool:
    device = getattr(transfer, "device", None)
    return (device is not None and device.type != "cpu") or cores_per_rank() > 1


class BatchIterator:
    """The iterator a step consumes: counts each batch handed out and knows, one batch ahead,
    whether any is left (`exhausted()`), so a step is never called on an empty epoch. A batch
    looked at ahead (`peek`, `peek_many`) counts only when it is handed out.

    `source` is a `Prefetcher` or any iterator of batches. `on_fetch(batch)` runs for every batch
    handed out; `limit` caps the batches of this epoch; `snapshot` is the Prefetcher's position
    after the last batch handed out (None for other sources).
    """

    def __init__(
        self, source: Iterator[Any], on_fetch: Callable[[Any], None] | None = None, limit: int | None = None
    ):
        self._source, self._on_fetch, self._limit = source, on_fetch, limit
        self._pairs = isinstance(source, Prefetcher)  # yields (batch, snapshot)
        self._ahead: list[tuple[Any, Any]] = []
        self._done = False
        self.fetched = 0
        self.snapshot: Any = None
        self.waited = 0.0  # seconds spent waiting for the source (data stalls)

    def __iter__(self) -> BatchIterator:
        return self

    def exhausted(self) -> bool:
        """True when the next `next()` would raise StopIteration (pulls one batch ahead)."""
        return not self._ahead and not self._pull_ahead()

    def _pull_ahead(self) -> bool:
        """Pull one more batch into the look-ahead; False at the end (or the limit)."""
        if self._done or (self._limit is not None and self.fetched + len(self._ahead) >= self._limit):
            return False
        start = time.perf_counter()
        try:
            item = next(self._source)
            self._ahead.append(item if self._pairs else (item, None))
        except StopIteration:
            self._done = True
        self.waited += time.perf_counter() - start
        return not self._done

    def peek(self) -> Any:
        """The next batch without taking it (None at the end)."""
        return None if self.exhausted() else self._ahead[0][0]

    def peek_many(self, count: int) -> list[Any]:
        """The next `count` batches (fewer at the end) without taking them: an optimizer step's
        micro-batches, whose items are counted before its first backward pass."""
        while len(self._ahead) < count and self._pull_ahead():
            pass
        return [batch for batch, _ in self._ahead[:count]]

    def __next__(self) -> Any:
        if self.exhausted():
            raise StopIteration
        batch, self.snapshot = self._ahead.pop(0)
        self.fetched += 1
        if self._on_fetch is not None:
            self._on_fetch(batch)
        return batch


class GeneratorDataset(torch.utils.data.IterableDataset):
    """Samples from a Python generator (a callable returning an iterator, or a re-iterable),
    dealt round-robin to data-parallel ranks: sample i goes to rank i % dp_size. A last,
    incomplete round is dropped so every rank sees the same number of samples."""

    def __init__(self, source: Any, dp_size: int, dp_rank: int):
        self.source, self.dp_size, self.dp_rank = source, dp_size, dp_rank

    def __iter__(self) -> Iterator[Any]:
        items = self.source() if callable(self.source) else iter(self.source)
        mine = None
        for i, sample in enumerate(items):
            if i % self.dp_size == self.dp_rank:
                mine = sample
            if i % self.dp_size == self.dp_size - 1:
                yield mine
