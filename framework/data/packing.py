"""Documents tokenized on the fly and packed into blocks of `block_size` tokens: the transform of a
stream's shard (`framework.data.streams`), so blocks are made as the data is read.

* **Contiguous** (the default): each document's tokens and an EOS, one after another, cut into
  blocks; a document may run on into the next block (GPT-style pretraining).
* **Documents kept apart** (`keep_apart=True`): a block holds whole documents (one longer than a
  block is cut into pieces of at most `block_size`, each its own document); the position ids
  restart at every document and the label of each document's first token is -100, so a model
  that reads packed sequences from position ids (Hugging Face models with sdpa or flash
  attention, run without a key/value cache) attends within documents only and the per-token
  loss equals the documents run one per row. The rest of a block is padding (label -100).

`tokenize(example)` gives a document's token ids (an EOS is appended), or a labelled document
`(ids, labels)` taken as it is (its own end, e.g. a chat template's end-of-turn token; labels
-100 where nothing is learned, as outside a conversation's assistant turns; an empty one is
skipped). Its labels travel with its tokens into the blocks.

Blocks are `{"input_ids", "labels"}` (+ `"position_ids"` when kept apart), Hugging Face's
convention: the model shifts the labels itself (`loss=model`); NumPy arrays, which loader
workers hand over cheaply (a stream's loader batches them into tensors). The last, partial block of a pass
is padded, not dropped: padding carries label -100, which no loss or item count sees.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from framework.data.labels import IGNORE_INDEX
from framework.data.streams import whole_number

Document = list[int] | tuple[list[int], list[int]]  # ids, or (ids, labels)


def _check(block_size: Any, eos_id: Any, pad_id: Any) -> None:
    """A block of at least one token, token ids that are ids (one line each, else `feed` of a
    block of 0 tokens would never end)."""
    whole_number("packed(block_size={})", block_size, 1)
    whole_number("packed(eos_id={})", eos_id, 0)
    whole_number("packed(pad_id={})", pad_id, 0)


class Packer:
    """One shard's packing (a `framework.data.streams.ShardTransform`)."""

    def __init__(
        self,
        shards: int,
        tokenize: Callable[[Any], Document],
        block_size: int,
        eos_id: int,
        keep_apart: bool = False,
        pad_id: int = 0,
    ):
        _check(block_size, eos_id, pad_id)
        self.shards, self.tokenize, self.block_size = shards, tokenize, int(block_size)
        self.eos_id, self.keep_apart, self.pad_id = eos_id, keep_apart, pad_id
        # Tokens not yet in a block: (shuffled position, offset of the first, tokens, labels), in order.
        self._pending: list[tuple[int, int, list[int], list[int]]] = []
        self._count = 0  # tokens pending

    def feed(self, position: int, example: Any, offset: int = 0) -> list[tuple[Any, tuple[int, int]]]:
        """Blocks that the document at `position` completes (its first `offset` tokens were packed
        before), each with where the block after it starts."""
        ids, labels = self._document(example)
        if self.keep_apart:
            return self._feed_apart(position, ids, labels, offset)
        if len(ids) > offset:
            self._pending.append((position, offset, ids[offset:], labels[offset:]))
            self._count += len(ids) - offset
        out = []
        while self._count >= self.block_size:
            out.append(self._cut())
        return out

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """The last, partial block of the pass, padded (nothing when no token is pending)."""
        if not self._count:
            return []
        last = self._pending[-1][0]
        pieces = [(tokens, labels) for _, _, tokens, labels in self._pending]
        self._pending, self._count = [], 0
        return [(self._block(pieces), (last + self.shards, 0))]

    def _document(self, example: Any) -> tuple[list[int], list[int]]:
        """A document's tokens and labels: its ids and an EOS (labels the tokens), or a labelled one."""
        out = self.tokenize(example)
        if isinstance(out, tuple):
            ids, labels = list(out[0]), list(out[1])
            if len(ids) != len(labels):
                raise ValueError(f"a labelled document has {len(ids)} tokens but {len(labels)} labels")
            return ids, labels
        ids = [*out, self.eos_id]
        return ids, ids

    # ------------------------------------------------------------------ contiguous
    def _cut(self) -> tuple[Any, tuple[int, int]]:
        """One block of the pending tokens; the rest stays pending."""
        tokens: list[int] = []
        labels: list[int] = []
        while len(tokens) < self.block_size:
            position, offset, ids, marks = self._pending[0]
            take = self.block_size - len(tokens)
            tokens += ids[:take]
            labels += marks[:take]
            if take >= len(ids):
                self._pending.pop(0)
            else:
                self._pending[0] = (position, offset + take, ids[take:], marks[take:])
        self._count -= len(tokens)
        if self._pending:
            nxt = (self._pending[0][0], self._pending[0][1])
        else:
            nxt = (position + self.shards, 0)
        block = {
            "input_ids": np.asarray(tokens, dtype=np.int64),
            "labels": np.asarray(labels, dtype=np.int64),
        }
        return block, nxt

    # ------------------------------------------------------------------ documents kept apart
    def _feed_apart(
        self, position: int, ids: list[int], labels: list[int], offset: int
    ) -> list[tuple[Any, tuple[int, int]]]:
        out = []
        ids, labels = ids[offset:], labels[offset:]
        while ids:
            piece, ids = ids[: self.block_size], ids[self.block_size :]
            marks, labels = labels[: self.block_size], labels[self.block_size :]
            if self._count + len(piece) > self.block_size:  # it starts the next block
                pieces = [(tokens, marked) for _, _, tokens, marked in self._pending]
                self._pending, self._count = [], 0
                out.append((self._block(pieces), (position, offset)))
            self._pending.append((position, offset, piece, marks))
            self._count += len(piece)
            offset += len(piece)
            if self._count == self.block_size:
                pieces = [(tokens, marked) for _, _, tokens, marked in self._pending]
                self._pending, self._count = [], 0
                out.append((self._block(pieces), (position, offset) if ids else (position + self.shards, 0)))
        return out

    def _block(self, pieces: list[tuple[list[int], list[int]]]) -> dict[str, np.ndarray]:
        """A block of documents (padded to `block_size`): input ids, labels (-100 on padding and,
        kept apart, on each document's first token) and position ids restarting per document."""
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for tokens, marks in pieces:
            ids += tokens
            labels += ([IGNORE_INDEX] + marks[1:]) if self.keep_apart else marks
            positions += list(range(len(tokens)))
        pad = self.block_size - len(ids)
        ids += [self.pad_id] * pad
        labels += [IGNORE_INDEX] * pad
        positions += [0] * pad
        block = {"input_ids": np.asarray(ids, dtype=np.int64), "labels": np.asarray(labels, dtype=np.int64)}
        if self.keep_apart:
            block["position_ids"] = np.asarray(positions, dtype=np.int64)
        return block


def packed(
    tokenize: Callable[[Any], Document],
    block_size: int,
    eos_id: int,
    keep_apart: bool = False,
    pad_id: int = 0,
) -> Callable[[int], Packer]:
    """A `Stream(transform=...)`: each shard's documents tokenized by `tokenize(example) -> ids`
    and packed into blocks (see the module doc). Picklable when `tokenize` is (a spawned loader
    worker gets it by pickling)."""
    _check(block_size, eos_id, pad_id)
    return functools.partial(
        Packer, tokenize=tokenize, block_size=block_size, eos_id=eos_id, keep_apart=keep_apart, pad_id=pad_id
    )
