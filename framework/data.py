"""Per-rank data loading: a shuffled, resumable training loader and an exact evaluation shard.

Training uses torchdata's `StatefulDataLoader` over a `DistributedSampler`, so a loader's
position (mid-epoch included) is part of a checkpoint. Evaluation gives every rank the same
number of batches (ZeRO-3 gathers parameters collectively: a rank with one batch more would
hang the others) and remembers how many samples of its shard are real, so padding never
counts in a metric.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader


class EvalShardSampler(Sampler[int]):
    """Rank `rank` takes items rank, rank+N, ...; shards are padded to equal length by repeating
    the first items, and `num_real` says how many of this rank's items are real."""

    def __init__(self, dataset_len: int, num_replicas: int, rank: int):
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.per_rank = math.ceil(dataset_len / num_replicas) if dataset_len else 0
        self.num_real = len(range(rank, dataset_len, num_replicas))

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

    Batches are dropped at the end of a shard so every rank takes the same number of steps.
    """
    n = dataset_len(dataset)
    if n // dp_size < micro_batch_size:
        raise ValueError(
            f"the training set has {n} samples: too few for {dp_size} rank(s) x micro-batch {micro_batch_size}; "
            "use a smaller batch size"
        )
    sampler: DistributedSampler = DistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed
    )
    return StatefulDataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
    )


def eval_loader(
    dataset: Dataset,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    collate_fn: Callable | None = None,
    num_workers: int = 0,
) -> DataLoader:
    """This rank's evaluation loader; `loader.sampler.num_real` samples of it are real."""
    sampler = EvalShardSampler(dataset_len(dataset), dp_size, dp_rank)
    return DataLoader(
        dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn, num_workers=num_workers
    )


def split_batch(batch: Any) -> tuple[tuple[Any, ...], Any]:
    """Split a batch into (model inputs, labels): the last element of a tuple/list is the label;
    a lone tensor or a dict is all inputs."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return (batch[0],), None
        return tuple(batch[:-1]), batch[-1]
    return (batch,), None


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch (the leading dimension of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (tuple, list)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1


class DeviceLoader:
    """What `Engine.dataloader` returns: `epochs` epochs of this rank's batches, already on the
    device (prefetched in the background), at most `steps_per_epoch` batches per epoch.

    For evaluation shards, `last_real` is how many samples of the batch just handed out are real
    (the rest pad the shard so every rank runs the same number of batches).
    """

    def __init__(
        self,
        loader: Any,
        transfer: Callable[[Any], Any],
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        prefetch: int = 2,
        global_batch_size: int | None = None,
        real_samples: int | None = None,
    ):
        self.loader, self.transfer, self.epochs = loader, transfer, epochs
        self.steps_per_epoch, self.prefetch = steps_per_epoch, prefetch
        self.global_batch_size = global_batch_size
        self.real_samples = real_samples
        self.last_batch: Any = None
        self.last_real: int | None = None
        self.epoch = 0

    def batches_per_epoch(self) -> int | None:
        """Batches each epoch yields, when the source has a length."""
        try:
            n = len(self.loader)
        except TypeError:
            return self.steps_per_epoch
        return min(n, self.steps_per_epoch) if self.steps_per_epoch is not None else n

    def __len__(self) -> int:
        per = self.batches_per_epoch()
        if per is None:
            raise TypeError("this loader's length is unknown (a generator source without steps_per_epoch)")
        return per * self.epochs

    def __iter__(self) -> Iterator[Any]:
        from framework.steps import Prefetcher

        for epoch in range(self.epochs):
            self.epoch = epoch
            sampler: Any = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            source = Prefetcher(iter(self.loader), self.transfer, depth=self.prefetch)
            remaining = self.real_samples
            try:
                for i, batch in enumerate(source):
                    if self.steps_per_epoch is not None and i >= self.steps_per_epoch:
                        break
                    if remaining is not None:
                        self.last_real = min(batch_size_of(batch), remaining)
                        remaining -= self.last_real
                    self.last_batch = batch
                    yield batch
            finally:
                source.close()


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
