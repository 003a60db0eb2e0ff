"""Best-fit-decreasing bins and padding-free rows (`framework.data.bins`): every document once,
within a row's capacity, the same bins whatever the number of ranks (packing comes before the
split over ranks, from the data alone), and a long-tailed set packed with at most 2 % padding."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from framework.data.bins import PackedCollator, best_fit_decreasing, pack_rows, pad_share
from framework.data.labels import IGNORE_INDEX


def long_tailed(count: int = 500, median: int = 200, longest: int = 2000, seed: int = 0) -> list[int]:
    """Conversation lengths drawn lognormal (median `median`), cut at `longest`: the issue's set."""
    rng = np.random.default_rng(seed)
    return [int(n) for n in np.clip(rng.lognormal(np.log(median), 1.0, count), 8, longest)]


def _documents(lengths: list[int]) -> list[tuple[list[int], list[int]]]:
    return [([i + 1] * n, [i + 1] * n) for i, n in enumerate(lengths)]


def test_every_document_lands_once_within_capacity_longest_first():
    lengths = [5, 3, 8, 2, 7, 1, 4]
    bins = best_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins == [[2, 3], [1, 4], [0, 5, 6]]  # 8+2, 7+3, 5+4+1: 30 tokens in three full bins


def test_a_row_is_its_documents_with_restarting_positions_and_no_padding():
    (row,) = pack_rows([([7, 8, 9], [7, 8, 9]), ([4, 5], [IGNORE_INDEX, 5])], capacity=6)
    assert row["input_ids"].tolist() == [7, 8, 9, 4, 5]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1]
    assert row["labels"].tolist() == [IGNORE_INDEX, 8, 9, IGNORE_INDEX, 5]  # none scored on the one before


def test_a_batch_is_padded_to_its_longest_row_only():
    rows = pack_rows([([1] * 4, [1] * 4), ([2] * 6, [2] * 6)], capacity=6)
    batch = PackedCollator(0)(rows)
    assert batch["input_ids"].shape == (2, 6) and "attention_mask" not in batch
    short = int(np.argmin([len(r["input_ids"]) for r in rows]))
    assert batch["labels"][short, 4:].eq(IGNORE_INDEX).all()
    assert batch["position_ids"][short].tolist() == [0, 1, 2, 3, 0, 1]  # the padding is a document of its own
    assert PackedCollator(0)(rows[:1])["input_ids"].shape == (1, len(rows[0]["input_ids"]))


def test_the_bins_are_the_same_on_every_number_of_ranks():
    """Packing is a pure function of the data: each rank's rows, whatever the world size, are
    rows of the one packing, and together they are all of it."""
    docs = _documents(long_tailed(200, seed=3))
    whole = {tuple(r["input_ids"].tolist()) for r in pack_rows(docs, 2048)}
    for world in (1, 2, 3, 4):
        seen: set[tuple[int, ...]] = set()
        for rank in range(world):
            rows = pack_rows(docs, 2048)  # each rank packs the data alone
            sampler = DistributedSampler(
                range(len(rows)), num_replicas=world, rank=rank, shuffle=True, seed=0
            )
            mine = {tuple(rows[i]["input_ids"].tolist()) for i in sampler}
            assert mine <= whole
            seen |= mine
        assert seen == whole


def test_a_long_tailed_set_packs_with_at_most_two_percent_padding():
    lengths = long_tailed()
    assert 150 <= int(np.median(lengths)) <= 250 and max(lengths) <= 2000
    bins = best_fit_decreasing(lengths, 2048)
    rows = [sum(lengths[i] for i in b) for b in bins]
    fill = sum(lengths) / (len(bins) * 2048)
    assert fill >= 0.98, fill  # the bins themselves are at least 98 % full
    assert pad_share(rows, batch=1) == 0.0  # padding-free rows
    assert pad_share(rows, batch=2) <= 0.02  # two rows a batch, padded to the longer
    greedy = pad_share(_greedy(lengths, 2048), capacity=2048)
    assert greedy > 0.05  # what fixed blocks filled in order left as padding


def _greedy(lengths: list[int], capacity: int) -> list[int]:
    blocks, used = [], 0
    for n in lengths:
        if used + n > capacity:
            blocks.append(used)
            used = 0
        used += n
    return [*blocks, used]


def test_padding_free_rows_count_every_label():
    docs = _documents([3, 9, 4, 4])
    rows = pack_rows(docs, 12)
    counted = sum(int((torch.as_tensor(r["labels"]) != IGNORE_INDEX).sum()) for r in rows)
    assert counted == sum(n - 1 for n in (3, 9, 4, 4))
