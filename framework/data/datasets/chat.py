"""Chat fine-tuning data from your own JSONL / JSON / Parquet files: rows rendered by the
tokenizer's chat template, labels on what the model must learn to say. Nothing is downloaded.

    python train.py model=hf_causal_lm model.path=DIR data=hf_chat \\
        data.dataset.data_files=chat.jsonl loss=model

Each file's format is told from its first row and said in one line (`data.dataset.format` sets
it): chat messages (`{"messages": [{"role", "content"}, ...]}`), ShareGPT conversations
(`from` / `value`), Alpaca rows (`instruction`, `input`, `output`) or prompt-completion rows
(`framework.data.datasets.formats`; `columns`, `message_keys` and `roles` for other names). The
tokenizer (the model directory's, or `tokenizer=DIR`) renders them with its chat template (or
`chat_template`, a Jinja string or file); labels are the assistant's tokens, or a completion's
(`framework.data.datasets.render`), -100 elsewhere; `train_on_prompt=True` labels every token.

A conversation longer than `max_length` tokens is cut there; one with no label that counts is
dropped (each counted, in one line). Rows are `{"input_ids", "labels", "attention_mask"}`, padded
per batch (pad token, labels -100), or with `pack=True` rows of whole conversations kept apart
(position ids restart): best-fit-decreasing bins of at most `max_length` tokens with no padding
inside, a batch padded only to its longest row (`framework.data.bins`), the same per-token loss
as unpacked; streamed (`streaming=True`), conversations are packed as they come into blocks of
`max_length` tokens, padded (`framework.data.packing`). A file's rows are rendered once and kept (`cache`,
`framework.data.datasets.cache`; a progress bar while it takes long). `streaming=True` reads the
files as a `framework.data.streams.Stream` (never loaded whole, exact resume).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np

from framework.data.bins import PackedCollator, pack_rows
from framework.data.datasets.cache import encoded_splits
from framework.data.datasets.classification import Splits
from framework.data.datasets.counted import say
from framework.data.datasets.formats import Reading
from framework.data.datasets.hf import EveryNth, TokenizedSplits, with_tokenizer
from framework.data.datasets.render import GENERATION_MARKER, ChatEncoder, chat_tokenizer, template_of
from framework.data.datasets.sources import WHERE, data_paths, first_row, streamed
from framework.data.datasets.text_classification import PadCollator
from framework.data.packing import packed
from framework.data.streams import DEFAULT_SHARDS, Stream
from framework.errors import ConfigError

__all__ = ["GENERATION_MARKER", "WHERE", "ChatEncoder", "chat_tokenizer", "hf_chat", "template_of"]


class ChatRows:
    """A stream's shard transform for unpacked chat: each kept conversation one row."""

    def __init__(self, shards: int, encoder: ChatEncoder):
        self.shards, self.encoder = shards, encoder

    def feed(self, position: int, example: Any, offset: int = 0) -> list[tuple[Any, tuple[int, int]]]:
        """The conversation's row (nothing when it is dropped)."""
        ids, labels = self.encoder(example)
        return [(_row(ids, labels), (position + self.shards, 0))] if ids else []

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """Nothing is held back."""
        return []


def _row(ids: Any, labels: Any) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "labels": np.asarray(labels, dtype=np.int64),
        "attention_mask": np.ones(len(ids), dtype=np.int64),
    }


def _as_dataset(rows: list[dict[str, np.ndarray]]) -> Any:
    import datasets

    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]}).with_format("torch")


def hf_chat(
    data_files: Any,
    messages_column: str | None = None,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    max_length: int = 1024,
    train_on_prompt: bool = False,
    pack: bool = False,
    val_fraction: float = 0.1,
    validation_files: Any = None,
    split_seed: int = 0,
    builder: str | None = None,
    streaming: bool = False,
    shards: int = DEFAULT_SHARDS,
    seed: int = 0,
    format: str | None = None,
    columns: Any = None,
    message_keys: Any = None,
    roles: Any = None,
    completion_tokens: str = "rendered",
    cache: Any = True,
) -> TokenizedSplits:
    """Rows of local JSONL / JSON / Parquet files (`builder` from the suffix) -> tokens whose
    labels are what the model learns to say (see the module doc). `format`, `messages_column`,
    `columns`, `message_keys`, `roles`: how rows are read (`framework.data.datasets.formats`);
    `completion_tokens`: `rendered` or `markers` (`framework.data.datasets.render`); `cache`:
    true, a directory, or false (`framework.data.datasets.cache`). Validation: `validation_files`,
    else `val_fraction` of the conversations (a fixed split by `split_seed`; streamed, every
    1/val_fraction-th); 0: none."""
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError(f"data.dataset.val_fraction={val_fraction}: must be in [0, 1)")
    tok = chat_tokenizer(tokenizer, chat_template)
    reading = Reading.of(format, messages_column, columns, message_keys, roles)
    encoder = functools.partial(
        ChatEncoder,
        tok,
        messages_column,
        max_length,
        train_on_prompt,
        reading=reading,
        completion_tokens=completion_tokens,
    )
    paths = data_paths(data_files)
    held_out = data_paths(validation_files, "validation_files") if validation_files is not None else None
    if streaming:
        every = round(1 / val_fraction) if val_fraction else 0
        train, valid = _streams(encoder, paths, held_out, builder, every, pack, shards, seed)
        return with_tokenizer(
            Splits(train, valid), tok, collate_fn=None if pack else PadCollator(_pad_id(tok))
        )
    conversations, validation = encoded_splits(
        encoder, paths, held_out, builder, cache, val_fraction, split_seed
    )
    splits = Splits(_rows(conversations, pack, max_length), _rows(validation, pack, max_length))
    collate = PackedCollator(_pad_id(tok)) if pack else PadCollator(_pad_id(tok))
    return with_tokenizer(splits, tok, collate_fn=collate)


def _rows(part: list[dict[str, np.ndarray]], pack: bool, max_length: int) -> Any:
    """Kept conversations as a dataset of rows, or of packed rows (None for none)."""
    if not part:
        return None
    pairs = [(c["input_ids"], c["labels"]) for c in part]
    rows = pack_rows(pairs, max_length) if pack else [_row(*c) for c in pairs]
    return _as_dataset(rows)


def _stream_reading(encoder: Any, paths: list[Path], builder: str | None) -> Any:
    """The encoder factory `encoder` set to read the files' format (told from each file's first
    row and said in one line; a stream's files share one)."""
    chat = encoder()
    found = set()
    for path in paths:
        where, row = first_row(path, builder)
        say(chat.read_as(where, row, path))
        found.add((chat.format.name, chat.format.column))
    if len(found) > 1:
        raise ConfigError(
            f"data.dataset.data_files: a stream reads files of one format, these are of {len(found)} "
            f"({', '.join(sorted(name for name, _ in found))}); convert them, or stream them one run at a time"
        )
    ((name, column),) = found
    reading = dataclasses.replace(chat.reading, format=name, messages_column=column)
    return functools.partial(encoder, reading=reading)


def _streams(
    encoder: Any, paths: list[Path], held_out: list[Path] | None, builder: str | None, every: int, pack: bool,
    shards: int, seed: int,
) -> tuple[Stream, Stream | None]:  # fmt: skip
    """The training and validation streams of the files (see `hf_chat`): `every` n-th conversation
    validates unless `held_out` files do (0: none)."""
    training = _stream_reading(encoder, paths, builder)
    checking = _stream_reading(encoder, held_out, builder) if held_out is not None else training

    def stream(data: Any, make: Any) -> Stream:
        chat = make()
        pad = _pad_id(chat.tok)
        if pack:
            transform = packed(chat, chat.max_length, pad, keep_apart=True, pad_id=pad)
            return Stream(data, transform, shards=shards, seed=seed, info={"tokenizer": chat.tok})
        rows = functools.partial(ChatRows, encoder=chat)
        return Stream(
            data, rows, shards=shards, seed=seed, collate_fn=PadCollator(pad), info={"tokenizer": chat.tok}
        )

    if held_out is not None:
        return stream(streamed(paths, builder), training), stream(streamed(held_out, builder), checking)
    if not every:
        return stream(streamed(paths, builder), training), None
    train = streamed(paths, builder).filter(EveryNth(every, held_out=False), with_indices=True)
    valid = streamed(paths, builder).filter(EveryNth(every, held_out=True), with_indices=True)
    return stream(train, training), stream(valid, training)


def _pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
