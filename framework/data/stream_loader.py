"""This rank's micro-batches of a `Stream` (`framework.data.streams`), read by torch loader workers.

Each worker is one reader of the stream (its shards), the loader takes the workers' items in
turn (torch's in-order round robin), which is this rank's global slots in order, and batches
them. Its `state_dict()` is where every shard of this rank stands after the last micro-batch it
handed out (plus the global slots consumed): the same on any layout, so a checkpoint resumes on
another one too (its ranks' shard positions merged).

A rank's stream ends at its first empty slot; the ranks agree on where a pass ends (the loop
before each optimizer step, evaluation before each batch: `framework.data.loaders.DeviceLoader`),
so no rank waits in a collective another rank never reaches. An evaluation pass (`to_the_end`)
reads every shard of the rank to its end instead: every item counts once, and the order (which
only makes training's global batches) does not matter there.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from framework.data.streams import Reader, Resume, Stream, whole_number
from framework.errors import CheckpointError, ConfigError


def collate_items(items: list[Any]) -> Any:
    """Items of equal shape into one batch: tensors stacked, numbers and lists of numbers made
    tensors, dicts and tuples field by field (a field of unequal lengths needs a `collate_fn`)."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(items)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(items))
    if isinstance(first, dict):
        return {key: collate_items([item[key] for item in items]) for key in first}
    if isinstance(first, (tuple, list)) and first and not isinstance(first[0], (int, float, bool)):
        return type(first)(collate_items(list(column)) for column in zip(*items))
    if isinstance(first, (int, float, bool)) or isinstance(first, (list, tuple)):
        try:
            return torch.tensor(items)
        except (ValueError, TypeError):
            raise ConfigError(
                "a stream's samples have fields of unequal lengths; give a collate_fn that pads them "
                "(data.collate_fn, or Stream(collate_fn=...)), or pack them (framework.data.packing)"
            ) from None
    return items


GROUP = 32  # items a worker hands over at once


def _start(loader: Any, workers: int) -> Iterator[Any]:
    """The loader's iterator, its workers forked with this process's objects frozen: a forked
    worker must not collect what it inherited (a torn-down process group's objects, DeepSpeed's,
    crashed a worker's garbage collection), so it collects only its own."""
    if not workers:
        return iter(loader)
    gc.collect()
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


def _as_is(item: Any) -> Any:
    return item


def own_generator(seed: int = 0) -> torch.Generator:
    """A generator for a loader's own draws. Each `iter(loader)` draws its workers' base seed,
    from the global torch generator unless the loader has one: a run resumed mid-epoch makes its
    iterator after the checkpoint put the global generator back, so that draw moved every dropout
    mask after a resume. With its own generator a loader never touches the model's randomness."""
    return torch.Generator().manual_seed(seed)


class _Readers(torch.utils.data.IterableDataset):
    """One rank's readers as a torch dataset: in loader worker j (of W) it is reader
    rank + D * ((j + first) mod W), so the loader's round robin over workers is the rank's slot order."""

    def __init__(
        self,
        stream: Stream,
        dp_size: int,
        dp_rank: int,
        epoch: int,
        resume: dict,
        first: int,
        to_the_end: bool,
    ):
        self.stream, self.dp_size, self.dp_rank = stream, dp_size, dp_rank
        self.epoch, self.resume, self.first, self.to_the_end = epoch, resume, first, to_the_end

    def __iter__(self) -> Iterator[tuple[list[tuple[Any, int, Resume]], int, int | None]]:
        """Groups of this reader's items (one message per group from a worker), with the
        reader's index among the rank's workers; the last group comes with the pass's source
        examples (`Reader.total`: -1 when the reader did not read to the source's end)."""
        info = torch.utils.data.get_worker_info()
        workers, index = (info.num_workers, info.id) if info is not None else (1, 0)
        worker = (index + self.first) % workers
        reader = self.dp_rank + self.dp_size * worker
        group: list[tuple[Any, int, Resume]] = []
        source = Reader(self.stream, reader, self.dp_size * workers, self.epoch, self.resume, self.to_the_end)
        for item in source:
            group.append(item)
            if len(group) == GROUP:
                yield group, worker, None
                group = []
        yield group, worker, -1 if source.total is None else source.total


def _one_line_errors(groups: Iterator[Any]) -> Iterator[Any]:
    """The workers' groups; a ConfigError a loader worker raised (which torch hands on with the
    worker's traceback in its message) as its own one line."""
    try:
        yield from groups
    except ConfigError as exc:
        lines = str(exc).strip().splitlines()
        if len(lines) < 2 or "Original Traceback" not in str(exc):
            raise
        raise ConfigError(lines[-1].split("ConfigError: ", 1)[-1]) from None


class StreamLoader:
    """This rank's micro-batches of `stream` (see the module doc); `drop_last=False` hands out a
    last, smaller batch too (evaluation), whose size is `last_size`; `to_the_end` reads every
    shard of the rank to its end, in the order its readers hand items over (evaluation)."""

    def __init__(
        self,
        stream: Stream,
        micro_batch_size: int,
        dp_size: int,
        dp_rank: int,
        num_workers: int = 0,
        drop_last: bool = True,
        collate_fn: Callable | None = None,
        to_the_end: bool = False,
    ):
        whole_number("micro_batch_size={}", micro_batch_size, 1)
        whole_number("num_workers={} (data.num_workers)", num_workers, 0)
        stream.readers(dp_size, num_workers)  # the layout divides the shards, or one line
        self.stream, self.batch_size = stream, int(micro_batch_size)
        self.dp_size, self.dp_rank, self.num_workers = dp_size, dp_rank, int(num_workers)
        self.drop_last, self.to_the_end = drop_last, to_the_end
        self.collate = collate_fn or stream.collate_fn or collate_items
        self.epoch = 0
        self._consumed = (
            0  # global slots before this rank's next one (a multiple of the global batch at a step)
        )
        self._resume: dict[int, Resume] = {}
        self._state = self._snapshot(self._consumed, self._resume)
        self.last_size = 0  # items in the last batch handed out
        self.total: int | None = None  # this pass's source examples, once a reader read them all

    # ------------------------------------------------------------------ position
    def set_epoch(self, epoch: int) -> None:
        """Pass `epoch` (its own shuffle) from its beginning, unless a loaded state is for it."""
        if epoch != self.epoch:
            self.epoch, self._consumed, self._resume, self.total = epoch, 0, {}, None
            self._state = self._snapshot(0, {})

    def _snapshot(self, consumed: int, resume: dict[int, Resume]) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": consumed,
            "shards": {c: r.as_dict() for c, r in resume.items()},
            "stream": self.stream.spec(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands after the last micro-batch handed out (see the module doc)."""
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` says (a state of this rank, or every rank's shards merged)."""
        if state.get("stream") != self.stream.spec():
            raise CheckpointError(
                f"the checkpoint's stream was read with {state.get('stream')} and this one is {self.stream.spec()}: "
                "its sample order would differ; resume with the same shards, shuffle window and seed"
            )
        self.epoch, self._consumed = int(state["epoch"]), int(state["consumed"])
        self._resume = {int(c): Resume(**r) for c, r in state["shards"].items()}
        self._state = self._snapshot(self._consumed, dict(self._resume))

    def __len__(self) -> int:
        raise TypeError("a stream has no length: bound training with max_steps (trainer.max_steps)")

    # ------------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[Any]:
        """This pass's micro-batches from where the loader stands. The workers start here, in the
        calling thread (the prefetch thread that reads the batches must not fork them)."""
        workers = max(1, self.num_workers)
        first = (self._consumed // self.dp_size) % workers
        resume = dict(self._resume)
        readers = _Readers(
            self.stream, self.dp_size, self.dp_rank, self.epoch, resume, first, self.to_the_end
        )
        loader = torch.utils.data.DataLoader(
            readers,
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_as_is,
            generator=own_generator(),
        )
        return self._batches(self._items(_start(loader, self.num_workers), workers))

    def _items(self, groups: Iterator[Any], workers: int) -> Iterator[tuple[Any, int, Resume]]:
        """This rank's items in slot order (item, slot, its shard's Resume), ending at its first
        empty slot: the next slot is missing and the reader that owns it has ended."""
        if self.to_the_end:
            yield from self._all_items(groups)
            return
        expected, ended = self._consumed + self.dp_rank, set()
        waiting: dict[int, tuple[Any, Resume]] = {}  # items of later slots, from the other workers

        def owner(slot: int) -> int:  # the reader of this rank's slot, as its index among the workers
            return (slot - self.dp_rank) // self.dp_size % workers

        for group, worker, total in _one_line_errors(groups):
            for item, slot, resume in group:
                waiting[slot] = (item, resume)
            if total is not None:
                ended.add(worker)
                self.total = total if total >= 0 else self.total
            while expected in waiting:
                item, resume = waiting.pop(expected)
                yield item, expected, resume
                expected += self.dp_size
            if owner(expected) in ended:
                return

    def _all_items(self, groups: Iterator[Any]) -> Iterator[tuple[Any, int, Resume]]:
        """Every item of this rank's readers, as they hand them over (`to_the_end`)."""
        for group, _, total in _one_line_errors(groups):
            self.total = total if total is not None and total >= 0 else self.total
            yield from group

    def padding_batch(self) -> Any:
        """A batch of the stream's first item, from any shard: what a rank whose share of an
        evaluation pass is empty runs while the others evaluate (padding: it counts for nothing)."""
        for item, _, _ in Reader(self.stream, 0, 1, self.epoch, {}, to_the_end=True):
            return self.collate([item])
        raise ConfigError("the stream is empty: give data with at least one sample")

    def left_behind(self, total: int) -> int:
        """Source examples of this rank's shards that a pass of `total` examples did not reach
        (a document the last block handed out ended inside counts as reached only when done)."""
        count, left = int(self.stream.shards), 0
        for c in range(self.dp_rank, count, self.dp_size):
            start = self._resume[c].position if c in self._resume else c
            left += max(0, -(-(total - start) // count))
        return left

    def _batches(self, items: Iterator[tuple[Any, int, Resume]]) -> Iterator[Any]:
        resume, shards = dict(self._resume), int(self.stream.shards)
        while True:
            taken, consumed = [], self._consumed
            for item, slot, position in items:
                taken.append(item)
                resume[slot % shards] = position
                consumed = slot - self.dp_rank + self.dp_size
                if len(taken) == self.batch_size:
                    break
            if not taken or (len(taken) < self.batch_size and self.drop_last):
                return
            self._consumed, self._resume, self.last_size = consumed, dict(resume), len(taken)
            self._state = self._snapshot(consumed, self._resume)
            yield self.collate(taken)
