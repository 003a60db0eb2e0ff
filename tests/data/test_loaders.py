"""Training loaders (`framework.data.loaders`): an epoch holds the same samples, in the same
global batches and steps, on every number of ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from framework.data.loaders import train_loader


def epoch_steps(samples: int, global_batch: int, ranks: int, epoch: int) -> list[list[int]]:
    """The sample ids of each global batch of one shuffled epoch, every rank's loader read."""
    data = TensorDataset(torch.arange(samples))
    loaders = [train_loader(data, global_batch // ranks, ranks, rank, seed=3) for rank in range(ranks)]
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
    per_rank = [[batch[0].tolist() for batch in loader] for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1  # every rank takes the same steps
    return [sorted(sum(parts, [])) for parts in zip(*per_rank)]


@pytest.mark.parametrize("samples, global_batch", [(7, 2), (14, 8), (13, 4)])
def test_an_epoch_trains_the_same_samples_and_steps_on_one_and_two_ranks(samples, global_batch):
    """7 conversations, global batch 2: 2 ranks padded the epoch with a repeated sample (8
    samples, 4 steps) where 1 rank left one out (6 samples, 3 steps)."""
    for epoch in (0, 1):
        one, two = epoch_steps(samples, global_batch, 1, epoch), epoch_steps(samples, global_batch, 2, epoch)
        assert one == two and len(one) == samples // global_batch
        trained = sum(one, [])
        assert len(set(trained)) == len(trained)  # no sample twice
