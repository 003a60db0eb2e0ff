"""Text classification from your own JSONL / CSV / Parquet files through Hugging Face `datasets`:
(text, label) rows, tokenized with a local tokenizer, padded per batch. Nothing is downloaded.

    python train.py data=hf_classification data.dataset.data_files=reviews.jsonl \\
        data.dataset.tokenizer=TOKENIZER_DIR model=hf_sequence_classification model.path=MODEL_DIR

Labels are integer class ids, or strings mapped to ids in sorted order (the mapping goes into the
model's `id2label` / `label2id`, so an exported model names its classes). Rows are dicts
`{"input_ids", "attention_mask", ..., "labels"}`: `loss=model` trains a Hugging Face classifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from framework.data.datasets.classification import Splits
from framework.data.datasets.hf import TokenizedSplits, load_local, load_tokenizer, with_tokenizer
from framework.data.labels import IGNORE_INDEX
from framework.errors import ConfigError

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


class PadCollator:
    """Stacks rows of different lengths into a batch: token ids (`*input_ids`) padded with
    `pad_id`, per-token labels (`*labels`) with -100 (a padded position counts nothing), every
    other sequence field (attention masks, token_type_ids) with 0, on the right, each field to its
    longest row (or to `common_length`); 0-d fields (labels of whole rows) stacked."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id

    def common_length(self, rows: Sequence[dict[str, Any]]) -> int | None:
        """One length every sequence field is padded to (None: each field to its own longest row)."""
        return None

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = self.common_length(rows)
        batch: dict[str, torch.Tensor] = {}
        for key in rows[0]:
            values = [torch.as_tensor(row[key]) for row in rows]
            if values[0].dim() == 0:
                batch[key] = torch.stack(values)
                continue
            fill = self.pad_id if key.endswith("input_ids") else IGNORE_INDEX if key.endswith("labels") else 0
            padded = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=fill)
            if length is not None and padded.shape[1] < length:
                more = padded.new_full((len(values), length - padded.shape[1], *padded.shape[2:]), fill)
                padded = torch.cat([padded, more], dim=1)
            batch[key] = padded
        return batch

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pad_id={self.pad_id})"


def _builder(files: list[str], builder: str | None) -> str:
    if builder:
        return builder
    kinds = {BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ConfigError(
            f"data.dataset.data_files: cannot tell the format of {', '.join(files)} from the suffix "
            f"({', '.join(BUILDERS)}); set data.dataset.builder=json|csv|parquet"
        )
    return str(kinds.pop())


def _load(files: Any, builder: str | None) -> Any:
    names = [files] if isinstance(files, str) else [str(f) for f in files]
    return load_local(_builder([str(Path(f).expanduser()) for f in names], builder), names)


def _label_names(parts: list[Any], column: str) -> list[str] | None:
    """Sorted names of string labels (their ids are their positions); None for integer labels,
    or the names a `ClassLabel` column carries."""
    feature = parts[0].features.get(column)
    if hasattr(feature, "names"):
        return list(feature.names)
    values = {v for part in parts for v in part[column]}
    if all(isinstance(v, (int, bool)) for v in values):
        if min(values) < 0:
            raise ConfigError(
                f"data.dataset.label_column={column}: class ids must be >= 0, found {min(values)}"
            )
        return None
    return sorted(str(v) for v in values)


def hf_classification(
    data_files: Any,
    text_column: str = "text",
    label_column: str = "label",
    tokenizer: str | None = None,
    validation_files: Any = None,
    builder: str | None = None,
    max_length: int = 128,
    val_fraction: float = 0.1,
    split_seed: int = 0,
) -> TokenizedSplits:
    """(text, label) rows of local files (`builder` from the suffix: .jsonl/.json, .csv,
    .parquet) -> tokenized rows, at most `max_length` tokens. `validation_files` are the
    validation set; without them `val_fraction` of the rows are, split with a fixed seed."""
    parts = [_load(data_files, builder)]
    if validation_files is not None:
        parts.append(_load(validation_files, builder))
    for part in parts:
        for key, column in (("text_column", text_column), ("label_column", label_column)):
            if column not in part.column_names:
                raise ConfigError(
                    f"data.dataset.{key}={column}: the files have columns {part.column_names}; name one of them"
                )
    names = _label_names(parts, label_column)
    strings = names is not None and not hasattr(parts[0].features.get(label_column), "names")
    ids = {name: i for i, name in enumerate(names or [])} if strings else {}
    tok = load_tokenizer(tokenizer)

    def encode(rows: dict[str, list[Any]]) -> dict[str, Any]:
        out = dict(tok([str(t) for t in rows[text_column]], truncation=True, max_length=max_length))
        out["labels"] = [ids[str(v)] if ids else int(v) for v in rows[label_column]]
        return out

    encoded = [p.map(encode, batched=True, remove_columns=p.column_names) for p in parts]
    if len(encoded) == 1:
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.dataset.val_fraction={val_fraction}: must be in (0, 1)")
        split = encoded[0].train_test_split(test_size=val_fraction, seed=split_seed)
        encoded = [split["train"], split["test"]]
    train, valid = (p.with_format("torch") for p in encoded)
    labels = names or [str(i) for i in range(max(int(max(p[label_column])) for p in parts) + 1)]
    return with_tokenizer(
        Splits(train, valid), tok, labels, PadCollator(getattr(tok, "pad_token_id", None) or 0)
    )
