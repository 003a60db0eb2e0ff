"""`DeviceLoader`: what `Engine.dataloader` hands a user's loop: epochs of this rank's batches,
already on the device, prefetched in the background, padding accounted for, and over a stream
ended on every rank together."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from framework.data.loaders import Prefetcher
from framework.data.outputs import batch_size_of


class DeviceLoader:
    """What `Engine.dataloader` returns: `epochs` epochs of this rank's batches, already on the
    device (prefetched in the background), at most `steps_per_epoch` batches per epoch.

    For evaluation shards, `last_unpadded` is how many samples of the batch just handed out are
    not padding (the padding evens the shards so every rank runs the same number of batches).
    `on_epoch(epoch)` runs before each epoch (the engine resets this mode's metrics there).

    Over a stream (a `StreamLoader`), `agree(flag) -> bool` (True on every rank when `flag` is
    True on every rank) makes the ranks end an epoch together: training stops at the first batch
    one rank lacks; evaluation (`pad=True`) runs until every rank's stream has ended, a rank whose
    stream ended handing out its last batch again, all of it padding (a rank whose share is empty
    pads with a sample of the stream: `StreamLoader.padding_batch`).
    """

    def __init__(
        self,
        loader: Any,
        transfer: Callable[[Any], Any],
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        prefetch: int = 2,
        global_batch_size: int | None = None,
        unpadded: int | None = None,
        on_epoch: Callable[[int], None] | None = None,
        agree: Callable[[bool], bool] | None = None,
        pad: bool = False,
    ):
        self.loader, self.transfer, self.epochs = loader, transfer, epochs
        self.agree, self.pad = agree, pad
        self.steps_per_epoch, self.prefetch = steps_per_epoch, prefetch
        self.global_batch_size = global_batch_size
        self.unpadded = unpadded
        self.on_epoch = on_epoch
        self.last_batch: Any = None
        self.last_unpadded: int | None = None
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
        for epoch in range(self.epochs):
            self.epoch = epoch
            if self.on_epoch is not None:
                self.on_epoch(epoch)
            set_epoch(self.loader, epoch)
            size = getattr(self.loader, "last_size", None)
            snapshot = (lambda: self.loader.last_size) if size is not None else None
            source = Prefetcher(iter(self.loader), self.transfer, depth=self.prefetch, snapshot=snapshot)
            remaining = self.unpadded
            try:
                for i, (batch, real) in enumerate(self._agreed(source)):
                    if self.steps_per_epoch is not None and i >= self.steps_per_epoch:
                        break
                    if remaining is not None:
                        self.last_unpadded = min(batch_size_of(batch), remaining)
                        remaining -= self.last_unpadded
                    elif real is not None:
                        self.last_unpadded = real
                    self.last_batch = batch
                    yield batch
            finally:
                source.close()

    def _agreed(self, source: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """The (batch, samples that count) pairs of one epoch, ended on every rank together."""
        if self.agree is None:
            yield from source
            return
        last = None
        while True:
            got = next(source, None)
            more = not self.agree(got is None) if self.pad else self.agree(got is not None)
            if not more:
                return
            if got is None and last is None:  # this rank's share is empty: it pads with any sample
                last = (self._on_device(self.loader.padding_batch()), 0)
            if got is not None:
                last = got
                yield got
            else:
                assert last is not None
                yield last[0], 0  # padding: every sample of it is left out

    def _on_device(self, batch: Any) -> Any:
        """A batch moved as the prefetcher moves them (`transfer`, or a Copier's copy and ready)."""
        moved = getattr(self.transfer, "copy", self.transfer)(batch)
        ready = getattr(self.transfer, "ready", None)
        return ready(moved) if ready is not None else moved


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a loader (its sampler, or a stream loader itself) which epoch comes."""
    sampler: Any = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    elif hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
