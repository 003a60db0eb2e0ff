"""Streams: iterable data (a torch `IterableDataset`, a Hugging Face `datasets.IterableDataset`, or
local files read lazily) with the guarantees of map-style data: every sample once per pass, the
same global batches on any layout, and an exact resume wherever a run stopped, as often as it stops.

The global order, which makes global batch k and never depends on the number of ranks or workers::

    source examples 0, 1, 2, ...   read in chunks of `chunk` examples; with a `shuffle_window`
                                   each chunk is permuted by a generator of (seed, epoch, chunk)
    shuffled position s            shard c = s mod C (C = `shards`, fixed by the stream), whose
                                   examples are transformed in order: kept as they are, or
                                   tokenized and packed into blocks (`framework.data.packing`)
    item p of shard c              global slot i = p * C + c; a pass ends at its first empty slot

Data-parallel rank r of D takes the slots i = r (mod D), in order, and its loader worker w of W
every W-th of those: the shards c = r + D w (mod D W), so D x W must divide C. Each shard is
transformed by one reader, and the samples of global batch k are the slots [k G, (k + 1) G)
whatever D and W are. Every reader scans the source; it transforms (tokenizes) only its shards.

Every item carries where its shard goes on after it (`Resume`): a chunk whose source position is
known, and the shuffled position and token offset the shard's next item starts at. The loader
keeps the latest of each shard for what was consumed, so a checkpoint holds every shard's exact
position, shuffle included, valid on any layout; a shard's reader re-reads at most the chunks
since that position.
"""

from __future__ import annotations

import itertools
import pickle
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from framework.errors import ConfigError

DEFAULT_SHARDS = 64  # divides by every power of two up to 64 ranks x workers
DEFAULT_CHUNK = 256  # source examples read together when nothing is shuffled
SHUFFLE_WINDOW = 1000  # examples permuted at a time when a stream is shuffled and says no window


def whole_number(written: str, value: Any, low: int) -> int:
    """`value` as an int when it is a whole number >= `low`, else a one-line ConfigError that
    shows it as the user wrote it: `written` with `{}` for the value (`data.dataset.shards={}`,
    `Stream(shards={})`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{written.format(repr(value))}: must be a whole number >= {low}")
    return int(value)


@dataclass(frozen=True)
class Resume:
    """Where a shard goes on: source chunk `chunk` starts at source position `state`; the shard's
    next item starts at shuffled position `position`, token `offset`; `items` were handed out."""

    chunk: int
    state: Any
    position: int
    offset: int = 0
    items: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain data, for a checkpoint."""
        return asdict(self)


class ShardTransform(Protocol):
    """What turns one shard's examples (fed in order) into its items."""

    def feed(self, position: int, example: Any, offset: int = 0) -> list[tuple[Any, tuple[int, int]]]:
        """Items the example at shuffled `position` completes (its first `offset` tokens already
        used), each with (position, offset) where the item after it starts."""
        ...

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """Items left when the pass's examples are all fed."""
        ...


class KeepExamples:
    """The transform of a stream whose examples are its samples: each example is one item."""

    def __init__(self, shards: int):
        self.shards = shards

    def feed(self, position: int, example: Any, offset: int = 0) -> list[tuple[Any, tuple[int, int]]]:
        """The example itself; the shard's next one is `shards` positions on."""
        return [(example, (position + self.shards, 0))]

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """Nothing is held back."""
        return []


def is_stream(data: Any) -> bool:
    """True for iterable data without indexing: a `Stream`, a torch `IterableDataset`, or a
    Hugging Face `datasets.IterableDataset`."""
    if isinstance(data, (Stream, torch.utils.data.IterableDataset)):
        return True
    return type(data).__name__ == "IterableDataset" and type(data).__module__.startswith("datasets.")


@dataclass
class Stream:
    """Iterable data and how its global order is made (see the module doc).

    `transform(shards)` makes a shard's `ShardTransform` (None: the examples are the samples;
    `framework.data.packing.packed` tokenizes and packs). `shards` is C; `shuffle_window`
    permutes each chunk of that many source examples (0: the source order); `collate_fn` batches
    the items (default: tensors of equal-length fields)."""

    data: Any
    transform: Callable[[int], ShardTransform] | None = None
    shards: int = DEFAULT_SHARDS
    shuffle_window: int = 0
    seed: int = 0
    collate_fn: Callable | None = None
    info: dict[str, Any] = field(default_factory=dict)  # what made it (its tokenizer, ...)

    def __post_init__(self) -> None:
        if isinstance(self.data, Stream):
            raise ConfigError("Stream(...) takes the data itself, not another Stream")
        whole_number("Stream(shards={})", self.shards, 1)
        whole_number("Stream(shuffle_window={})", self.shuffle_window, 0)
        whole_number("Stream(seed={})", self.seed, 0)

    @property
    def chunk(self) -> int:
        """Source examples read together (the shuffle window, when there is one)."""
        return int(self.shuffle_window) or DEFAULT_CHUNK

    def spec(self) -> dict[str, int]:
        """What fixes the global order: a checkpoint resumes only with the same."""
        return {
            "shards": int(self.shards),
            "shuffle_window": int(self.shuffle_window),
            "seed": int(self.seed),
        }

    def readers(self, dp_size: int, workers: int) -> int:
        """Readers of a layout (data-parallel ranks x loader workers), or a one-line error when
        they do not divide the shards."""
        readers = dp_size * max(1, workers)
        if self.shards % readers:
            raise ConfigError(
                f"a stream of {self.shards} shards does not divide over {dp_size} data-parallel rank(s) x "
                f"{max(1, workers)} loader worker(s) = {readers} readers; use a worker count that divides "
                f"it, or Stream(shards=...) a multiple of {readers} (shards fix the sample order)"
            )
        return readers

    def permutation(self, epoch: int, chunk: int, size: int) -> np.ndarray:
        """The order of chunk `chunk`'s `size` examples (the identity without a shuffle window)."""
        if not self.shuffle_window:
            return np.arange(size)
        return np.random.default_rng([int(self.seed), int(epoch), int(chunk)]).permutation(size)

    def shard_transform(self) -> ShardTransform:
        """A fresh transform for one shard."""
        return (
            self.transform(int(self.shards)) if self.transform is not None else KeepExamples(int(self.shards))
        )


def as_stream(data: Any, shuffle_window: int = 0, seed: int = 0) -> Stream:
    """`data` as a `Stream` (a Stream as it is; other iterable data with these settings)."""
    return data if isinstance(data, Stream) else Stream(data, shuffle_window=shuffle_window, seed=seed)


# ---------------------------------------------------------------------------------------- reading


def _chunks(
    data: Any, size: int, start: Any, epoch: int, files: Any = ()
) -> Iterator[tuple[Any, list[Any], Any]]:
    """(source position at the chunk's start, its examples, position after it), from position
    `start` (None: the beginning). A Hugging Face `IterableDataset` (read through a copy made by
    pickling, so each reader has its own iteration state) and any source with `state_dict` / `load_state_dict` (a
    torchdata `Stateful`) resume there; any other is re-read and skipped (its position is the
    number of examples before the chunk)."""
    if type(data).__module__.startswith("datasets.") and hasattr(data, "iter"):
        plain = data.with_format(None)
        try:  # its own iteration state (a function in it that does not pickle: this one, shared)
            plain = pickle.loads(pickle.dumps(plain))
        except (pickle.PicklingError, AttributeError, TypeError):
            pass
        plain.set_epoch(epoch)
        if start is not None:
            plain.load_state_dict(start)
        position = start
        # Its public `iter`: its `__iter__` splits itself among torch's loader workers.
        batches = plain.iter(batch_size=size)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as exc:
                error = _unreadable(exc, plain, list(files))
                if error is exc:
                    raise
                raise error from None
            examples = [dict(zip(batch, values)) for values in zip(*batch.values())]
            after = plain.state_dict()
            yield position, examples, after
            position = after
    if hasattr(data, "set_epoch"):
        data.set_epoch(epoch)
    stateful = callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None)
    )
    if stateful and start is not None:
        data.load_state_dict(start)
    items: Iterator[Any] = iter(data)
    counted = 0 if stateful or not start else int(start)
    if counted:
        items = itertools.islice(items, counted, None)
    position = start if stateful else counted
    while chunk := list(itertools.islice(items, size)):
        counted += len(chunk)
        after = data.state_dict() if stateful else counted
        yield position, chunk, after
        position = after


def _unreadable(exc: Exception, source: Any, files: list[str]) -> Exception:
    """A source file that cannot be parsed as one line naming it and the row (Hugging Face
    `datasets` raises pyarrow's or pandas' error without the file, after logging it); any
    other error as it is."""
    if type(exc).__module__.split(".")[0] not in ("pyarrow", "pandas", "datasets", "json"):
        return exc
    shard = _innermost(source.state_dict(), "shard_idx")
    where = files[shard] if isinstance(shard, int) and 0 <= shard < len(files) else "a data file"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    row = re.search(r"in row (\d+)", first)
    at = f"line {int(row.group(1)) + 1}" if row else "a row"
    return ConfigError(f"{where}: {at} cannot be read ({first}); fix or remove it")


def _innermost(state: Any, key: str) -> Any:
    """The value of `key` in the innermost dict of a nested Hugging Face stream state."""
    found = None
    while isinstance(state, dict):
        found = state.get(key, found)
        state = state.get("examples_iterable")
    return found


@dataclass
class _Shard:
    """One shard in a reader: its transform, where it resumes, and its items made, not handed out."""

    resume: Resume
    transform: ShardTransform
    ready: list[tuple[Any, tuple[int, int]]] = field(default_factory=list)


class Reader:
    """Reader `reader` of `readers`: its shards' items in global-slot order for pass `epoch`, each
    as (item, global slot, its shard's `Resume` after it); `resume` says where each shard
    continues (a shard absent from it starts at the beginning). It ends at its first empty slot,
    or with `to_the_end` once every one of its shards has ended (evaluation: every item counts,
    the order does not)."""

    def __init__(
        self,
        stream: Stream,
        reader: int,
        readers: int,
        epoch: int,
        resume: dict[int, Resume],
        to_the_end: bool = False,
    ):
        self.stream, self.epoch, self.to_the_end = stream, epoch, to_the_end
        self.total: int | None = None  # the pass's source examples, once this reader read them all
        self.shards = {
            c: _Shard(resume.get(c) or Resume(0, None, c), stream.shard_transform())
            for c in range(reader, int(stream.shards), readers)
        }

    def __iter__(self) -> Iterator[tuple[Any, int, Resume]]:
        stream, shards, size = self.stream, self.shards, self.stream.chunk
        first = min(shards.values(), key=lambda s: s.resume.chunk).resume
        chunks = _chunks(stream.data, size, first.state, self.epoch, stream.info.get("files", ()))
        known: dict[int, Any] = {}  # chunk -> source position at its start
        index, ended = first.chunk, False
        read = index * size  # source examples before the next chunk
        live = dict(shards)  # the shards that may still have items
        while live:
            c = min(live, key=lambda k: (live[k].resume.items, k))  # the next global slot
            shard = live[c]
            while not shard.ready and not ended:
                try:
                    start, examples, after = next(chunks)
                except StopIteration:
                    ended, self.total = True, read
                    for s in shards.values():
                        s.ready += s.transform.flush()
                    break
                known[index], known[index + 1] = start, after
                self._dispatch(index, examples)
                index, read = index + 1, read + len(examples)
            if not shard.ready:
                if not self.to_the_end:
                    return  # this reader's first empty slot: the pass ends there
                del live[c]
                continue
            item, (position, offset) = shard.ready.pop(0)
            chunk = min(position // size, index)  # a chunk read, or the next one (its start is known)
            shard.resume = Resume(chunk, known.get(chunk), position, offset, shard.resume.items + 1)
            yield item, (shard.resume.items - 1) * int(stream.shards) + c, shard.resume
            oldest = min(s.resume.chunk for s in shards.values())
            for k in [k for k in known if k < oldest]:
                del known[k]

    def _dispatch(self, index: int, examples: list[Any]) -> None:
        """Feed each shard its examples of chunk `index`, in shuffled order."""
        base, count = index * self.stream.chunk, int(self.stream.shards)
        for k, j in enumerate(self.stream.permutation(self.epoch, index, len(examples))):
            position = base + k
            shard = self.shards.get(position % count)
            if shard is None or position < shard.resume.position:
                continue
            offset = shard.resume.offset if position == shard.resume.position else 0
            shard.ready += shard.transform.feed(position, examples[int(j)], offset)
