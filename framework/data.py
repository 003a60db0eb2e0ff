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
