"""Text from your own files through Hugging Face `datasets`, tokenized and cut into blocks for
causal language modelling. Nothing is downloaded: the files are local and the default tokenizer
is byte-level (UTF-8 bytes are the tokens, 256 of them).

    python train.py data=hf_text data.dataset.data_files=notes.txt model=hf_gpt2 loss=model

With `model.path=DIR` and no `data.dataset.tokenizer`, the model's directory is the tokenizer
(when it holds one: the run says so in one line). Rows are dicts `{"input_ids": block, "labels": block}` (Hugging Face's convention: the model
shifts the labels itself), so `loss=model` trains on them; the position in the epoch is part of
a checkpoint like any other data.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from framework.data.datasets.classification import Splits
from framework.data.packing import packed
from framework.data.streams import DEFAULT_SHARDS, Stream, whole_number
from framework.errors import ConfigError
from framework.integrations import hf

BYTE_VOCAB_SIZE = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255): a tokenizer that needs no file and no download (byte 0,
    which text does not hold, ends a document and pads)."""

    vocab_size = BYTE_VOCAB_SIZE
    pad_token_id = 0
    eos_token_id = 0

    def __call__(
        self, texts: list[str], truncation: bool = False, max_length: int | None = None
    ) -> dict[str, list[list[int]]]:
        ids = [list(text.encode("utf-8")) for text in texts]
        if truncation and max_length:
            ids = [row[:max_length] for row in ids]
        return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]}

    def __len__(self) -> int:
        return BYTE_VOCAB_SIZE


def load_tokenizer(tokenizer: str | None) -> Any:
    """The byte tokenizer (None / "bytes"), a local tokenizer directory (`AutoTokenizer`), or a
    `tokenizers` JSON file."""
    if tokenizer in (None, "bytes"):
        return ByteTokenizer()
    path = Path(str(tokenizer)).expanduser()
    if path.exists():
        return hf.tokenizer_from(path)
    raise FileNotFoundError(
        f"data.dataset.tokenizer={tokenizer}: no such directory or file (or use bytes, the default)"
    )


def vocabulary_size(tokenizer: Any) -> int:
    """Token ids the tokenizer can produce (added tokens included)."""
    return len(tokenizer)


class TokenizedSplits(Splits):
    """`Splits` made with a tokenizer: it travels with them, so a run checks it against the
    model's vocabulary and keeps its files beside the checkpoints (`export --hf` copies them);
    `labels` (classification) become the model's `id2label`; `collate_fn` batches the rows."""

    tokenizer: Any = None
    labels: list[str] | None = None
    collate_fn: Any = None


def with_tokenizer(
    splits: Splits, tokenizer: Any, labels: list[str] | None = None, collate_fn: Any = None
) -> TokenizedSplits:
    """`splits` with what made them (see `TokenizedSplits`)."""
    out = TokenizedSplits(*splits)
    out.tokenizer, out.labels, out.collate_fn = tokenizer, labels, collate_fn
    return out


def load_local(
    builder: str, data_files: Any, streaming: bool = False, key: str = "data.dataset.data_files"
) -> Any:
    """Local files through Hugging Face `datasets` (`builder`: text, json, csv, parquet), the
    `train` split, without a progress bar and without the network: `datasets` otherwise sends a
    download-count request to the hub for each load (and waits for it behind a dead proxy)."""
    import datasets

    names = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
    missing = [str(f) for f in names if not Path(f).expanduser().is_file()]
    if missing:
        raise FileNotFoundError(f"{key}: no such file: {', '.join(missing)}")
    datasets.disable_progress_bars()
    paths = [str(Path(f).expanduser()) for f in names]
    with _datasets_offline():
        return datasets.load_dataset(builder, data_files=paths, split="train", streaming=streaming)


@contextlib.contextmanager
def _datasets_offline() -> Iterator[None]:
    """`datasets` offline while the block runs (its module settings, read at each load)."""
    from datasets import config

    saved = config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS
    config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS = True, False
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS = saved


def hf_text(
    data_files: Any,
    builder: str = "text",
    text_column: str = "text",
    tokenizer: str | None = None,
    block_size: int = 128,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    num_proc: int | None = None,
) -> TokenizedSplits:
    """Local text / JSON / CSV files (`builder`: text, json, csv) -> tokenized blocks of
    `block_size` tokens, split into train / validation with a fixed seed."""

    whole_number("data.dataset.block_size={}", block_size, 1)
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, (int, float))
        or not 0 < val_fraction < 1
    ):
        raise ConfigError(f"data.dataset.val_fraction={val_fraction!r}: must be a number between 0 and 1")
    raw = load_local(builder, data_files)
    if text_column not in raw.column_names:
        raise ConfigError(
            f"data.dataset.text_column={text_column}: the files have columns {raw.column_names}; name one of them"
        )
    if not _is_text_feature(raw.features[text_column]):
        raise not_text(text_column, raw[0][text_column])
    tok = load_tokenizer(tokenizer)

    def tokenize(rows: dict[str, list[Any]]) -> dict[str, Any]:
        return {"input_ids": tok([str(t) for t in rows[text_column]])["input_ids"]}

    def blocks(rows: dict[str, list[Any]]) -> dict[str, Any]:
        ids = [i for row in rows["input_ids"] for i in row]
        cut = len(ids) // block_size * block_size
        chunks = [ids[i : i + block_size] for i in range(0, cut, block_size)]
        return {"input_ids": chunks, "labels": [list(c) for c in chunks]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names, num_proc=num_proc)
    grouped = tokenized.map(blocks, batched=True, batch_size=1000, num_proc=num_proc)
    if len(grouped) < 2:
        raise ConfigError(
            f"data.dataset.data_files hold too little text for two blocks of {block_size} tokens; "
            "use more text or a smaller data.dataset.block_size"
        )
    parts = grouped.train_test_split(test_size=val_fraction, seed=split_seed)
    return with_tokenizer(
        Splits(parts["train"].with_format("torch"), parts["test"].with_format("torch")), tok
    )


def hf_stream(
    data_files: Any,
    builder: str = "text",
    text_column: str = "text",
    tokenizer: str | None = None,
    block_size: int = 128,
    keep_documents_apart: bool = False,
    validation_files: Any = None,
    val_every: int = 20,
    shards: int = DEFAULT_SHARDS,
    seed: int = 0,
) -> TokenizedSplits:
    """Local text / JSON / Parquet files (`builder`) streamed through Hugging Face `datasets`
    (never loaded whole), tokenized as they are read and packed into blocks of `block_size`
    tokens (`framework.data.packing`; `keep_documents_apart` for blocks whose documents do not
    attend to each other). Validation: `validation_files`, else every `val_every`-th document.
    Train with `trainer.max_steps` (a stream has no length)."""
    import datasets

    _check_stream_options(builder, block_size, val_every if validation_files is None else 2, shards, seed)
    datasets.disable_progress_bars()
    # Its JSON reader logs a parse error before raising it; the stream names file and line instead.
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    tok = load_tokenizer(tokenizer)
    eos = getattr(tok, "eos_token_id", None)
    eos = eos if eos is not None else getattr(tok, "pad_token_id", None) or 0
    pad = getattr(tok, "pad_token_id", None) or 0

    def read(files: Any) -> Any:
        return load_local(builder, files, streaming=True)

    def stream(data: Any, files: Any) -> Stream:
        transform = packed(_Tokenize(tok, text_column), block_size, eos, keep_documents_apart, pad)
        info = {"tokenizer": tok, "files": _local(files)}
        return Stream(data, transform, shards=shards, seed=seed, info=info)

    raw = read(data_files)
    if validation_files is not None:
        train, valid = stream(raw, data_files), stream(read(validation_files), validation_files)
    else:
        held_out = read(data_files).filter(EveryNth(int(val_every), held_out=True), with_indices=True)
        train = stream(raw.filter(EveryNth(int(val_every), held_out=False), with_indices=True), data_files)
        valid = stream(held_out, data_files)
    return with_tokenizer(Splits(train, valid), tok)


def _local(files: Any) -> list[str]:
    """Data files as local paths (a file or a list of them)."""
    return [str(Path(f).expanduser()) for f in ([files] if isinstance(files, str) else list(files))]


STREAM_BUILDERS = ("text", "json", "parquet", "csv")


def _check_stream_options(builder: Any, block_size: Any, val_every: Any, shards: Any, seed: Any) -> None:
    """Each of `hf_stream`'s numbers and its builder, or one line naming the config key."""
    if builder not in STREAM_BUILDERS:
        raise ConfigError(f"data.dataset.builder={builder}: use one of {', '.join(STREAM_BUILDERS)}")
    whole_number("data.dataset.block_size={}", block_size, 1)
    whole_number("data.dataset.shards={}", shards, 1)
    whole_number("data.dataset.seed={}", seed, 0)
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise ConfigError(
            f"data.dataset.val_every={val_every!r}: must be a whole number >= 2 (every val_every-th "
            "document validates), or give data.dataset.validation_files"
        )


class _Tokenize:
    """A document's token ids (picklable: a spawned loader worker gets the stream by pickling)."""

    def __init__(self, tokenizer: Any, text_column: str):
        self.tokenizer, self.text_column = tokenizer, text_column

    def __call__(self, example: dict[str, Any]) -> list[int]:
        if self.text_column not in example:
            raise ConfigError(
                f"data.dataset.text_column={self.text_column}: the files' rows have {sorted(example)}; "
                "name one of them"
            )
        text = example[self.text_column]
        if not isinstance(text, str):
            raise not_text(self.text_column, text)
        return list(self.tokenizer([text])["input_ids"][0])


def _is_text_feature(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def not_text(column: str, value: Any) -> ConfigError:
    """The one-line error for a text column whose values are not text (a message list is chat data:
    training on its Python `str()` would be silent nonsense)."""
    if isinstance(value, (list, tuple)) and (not value or isinstance(value[0], dict)):
        return ConfigError(
            f"data.dataset.text_column={column} holds lists of messages, not text: for conversations use "
            f"data=hf_chat data.dataset.messages_column={column} (labels on the assistant's turns only)"
        )
    return ConfigError(
        f"data.dataset.text_column={column} holds {type(value).__name__} values, not text: name a text column"
    )


class EveryNth:
    """The documents a stream keeps (picklable, as a stream's reader copies its source so)."""

    def __init__(self, n: int, held_out: bool):
        self.n, self.held_out = n, held_out

    def __call__(self, example: Any, index: int) -> bool:
        return (index % self.n == 0) == self.held_out
