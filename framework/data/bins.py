"""Padding-free packing of whole documents (conversations): best-fit-decreasing bins within a
row's capacity, each bin one row of its documents one after another.

* **Bins** (`best_fit_decreasing`): documents longest first (ties: in their order), each into the
  fullest bin it still fits, else a new bin. A pure function of the lengths and the capacity, so
  the packing is the same on every number of ranks and on every resume: it is made before the
  rows are split over ranks, from the data alone.
* **Rows** (`pack_rows`): a bin's documents in their order, no padding: `input_ids`, `labels`
  (-100 on each document's first token, so no document is scored on the one before it) and
  `position_ids` restarting at every document. Rows differ in length.
* **Batches** (`PackedCollator`): rows padded only to the batch's longest (a batch of one row is not
  padded); the padding is one more document of pad tokens (labels -100, position ids from 0), and no
  `attention_mask` is made: the position ids tell the documents apart, and
  `framework.integrations.packed` keeps the attention within them however the model is called.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from framework.data.labels import IGNORE_INDEX


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of document indices (each bin's in increasing order), every bin's total length at
    most `capacity`; a document longer than `capacity` is an error (cut it first)."""
    capacity = int(capacity)
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in order:
        size = int(lengths[i])
        if size > capacity:
            raise ValueError(f"document {i} has {size} tokens, more than a row's {capacity}")
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - size > 0:
            bisect.insort(free, (room - size, b))
    return [sorted(b) for b in bins]


def pack_rows(documents: Sequence[tuple[Any, Any]], capacity: int) -> list[dict[str, np.ndarray]]:
    """`documents` ((ids, labels) each, at most `capacity` tokens) as padding-free rows of
    best-fit-decreasing bins (see the module doc)."""
    bins = best_fit_decreasing([len(ids) for ids, _ in documents], capacity)
    return [_row([documents[i] for i in b]) for b in bins]


def _row(pieces: list[tuple[Any, Any]]) -> dict[str, np.ndarray]:
    ids = np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in pieces])
    labels = np.concatenate([np.asarray(m, dtype=np.int64) for _, m in pieces])
    starts = np.cumsum([0] + [len(t) for t, _ in pieces[:-1]])
    labels[starts] = IGNORE_INDEX
    positions = np.concatenate([np.arange(len(t), dtype=np.int64) for t, _ in pieces])
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def pad_share(rows: Sequence[int], batch: int = 1, capacity: int | None = None) -> float:
    """The share of padding tokens in batches of `batch` consecutive rows of lengths `rows`,
    each padded to its longest row (to `capacity` when given: fixed-size blocks)."""
    real = padded = 0
    for start in range(0, len(rows), batch):
        group = rows[start : start + batch]
        real += sum(group)
        padded += len(group) * (capacity if capacity is not None else max(group))
    return 1 - real / padded if padded else 0.0


class PackedCollator:
    """Padding-free rows into one batch (see the module doc): `input_ids` padded with `pad_id`,
    `labels` with -100, `position_ids` 0, 1, ... over the padding."""

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        out: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": []}
        for r in rows:
            pad = longest - len(r["input_ids"])
            fill = {"input_ids": torch.full((pad,), self.pad_id), "labels": torch.full((pad,), IGNORE_INDEX)}
            fill["position_ids"] = torch.arange(pad)
            for key in out:
                out[key].append(torch.cat([torch.as_tensor(r[key], dtype=torch.long), fill[key]]))
        return {key: torch.stack(values) for key, values in out.items()}
