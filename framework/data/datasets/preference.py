"""Preference pairs from your own JSONL / Parquet files, for DPO (`+objective=dpo`).

    python train.py model=hf_causal_lm model.path=DIR data=hf_preference \\
        data.dataset.data_files=pairs.jsonl +objective=dpo

Each row holds `prompt` (a string: one user message; or a list of chat messages) and `chosen` /
`rejected` (strings: one assistant message each; or assistant messages). Each answer is rendered
after the prompt by the tokenizer's chat template, as `data=hf_chat` renders a conversation
(`framework.data.datasets.chat.ChatEncoder`); its labels are the answer's assistant tokens only
(-100 on the prompt, even on a prompt's own assistant turns). An answer longer than
`max_length` tokens is cut there (counted, in one line); a pair with an answer left with no
label (cut before its first answer token) is dropped (counted, in one line).

Rows are `{chosen_input_ids, chosen_labels, chosen_attention_mask, rejected_input_ids, ...}`;
`PairCollator` pads a batch's chosen and rejected rows to one length (the DPO step runs them in
one forward pass). With `streaming=True` the files are read as a `framework.data.streams.Stream`
(never loaded whole, exact resume); reference log-probabilities cannot be stored with a stream
(`objective.precompute_reference`), a frozen copy or adapters give them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from framework.data.datasets.chat import (
    WHERE,
    ChatEncoder,
    _builder,
    _pad_id,
    _paths,
    _Where,
    _where,
    chat_tokenizer,
)
from framework.data.datasets.classification import Splits
from framework.data.datasets.counted import Counted
from framework.data.datasets.hf import TokenizedSplits, load_local, with_tokenizer
from framework.data.datasets.text_classification import PadCollator
from framework.data.labels import IGNORE_INDEX, counts_nothing
from framework.data.streams import DEFAULT_SHARDS, Stream
from framework.errors import ConfigError

SIDES = ("chosen", "rejected")


def _messages(value: Any, role: str, where: str, key: str) -> list[dict[str, Any]]:
    """A string as one `role` message; a message dict or a list of them as they are."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in value]
    raise ConfigError(f"{where}: '{key}' must be a string or a list of {{role, content}} messages")


class PairEncoder(Counted):
    """One row -> the chosen and rejected `(input_ids, labels)`, or None for a dropped pair.
    Counts what it cut and dropped (`seen`, `truncated`, `dropped`)."""

    unit, cut = "pairs", "answers "

    def __init__(self, tokenizer: Any, max_length: int, columns: tuple[str, str, str]):
        self.chat = ChatEncoder(tokenizer, "messages", max_length, train_on_prompt=False)
        self.prompt_key, self.chosen_key, self.rejected_key = columns
        self.max_length = int(max_length)
        super().__init__()

    def encode(self, row: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
        """The pair of `row` (the file and line `where`) as a row of arrays."""
        for key in (self.prompt_key, self.chosen_key, self.rejected_key):
            if row.get(key) is None:
                present = sorted(k for k, v in row.items() if v is not None)
                raise ConfigError(
                    f"{where}: no '{key}' in the row (it has {present}); a pair needs prompt, chosen and "
                    "rejected (data.dataset.prompt_column / chosen_column / rejected_column name them)"
                )
        self.seen += 1
        prompt = _messages(row[self.prompt_key], "user", where, self.prompt_key)
        out: dict[str, np.ndarray] = {}
        for side, key in zip(SIDES, (self.chosen_key, self.rejected_key)):
            answer = _messages(row[key], "assistant", where, key)
            ids, labels = self.answer(prompt, answer, where)
            if counts_nothing(labels):
                self.dropped += 1
                return None
            out[f"{side}_input_ids"] = np.asarray(ids, dtype=np.int64)
            out[f"{side}_labels"] = np.asarray(labels, dtype=np.int64)
            out[f"{side}_attention_mask"] = np.ones(len(ids), dtype=np.int64)
        return out

    def answer(
        self, prompt: list[dict[str, Any]], answer: list[dict[str, Any]], where: str
    ) -> tuple[list[int], list[int]]:
        """The tokens of the prompt then the answer, labels on the answer's assistant tokens."""
        ids, mask = self.chat.assistant_tokens(prompt + answer, where)
        before = self.chat._ids(prompt, where, add_generation_prompt=True)
        if ids[: len(before)] != before:
            raise ConfigError(
                f"{where}: the chat template renders the prompt as other tokens than the pair's beginning; "
                "use a template whose renders of a conversation's beginnings begin it (data.dataset.chat_template)"
            )
        labels = [t if m and i >= len(before) else IGNORE_INDEX for i, (t, m) in enumerate(zip(ids, mask))]
        if len(ids) > self.max_length:
            self.truncated += 1
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        return ids, labels

    def why(self) -> str:
        """Why a pair is dropped, in words."""
        return (
            f"an answer with no token within max_length={self.max_length} (the prompt fills it); "
            "data.dataset.max_length to change"
        )


class PairCollator(PadCollator):
    """Pads a batch's chosen and rejected rows to one common length (input ids with `pad_id`,
    labels with -100, masks with 0, on the right), so the DPO step runs them in one forward pass;
    0-d fields (reference log-probabilities) are stacked."""

    def common_length(self, rows: Sequence[dict[str, Any]]) -> int:
        return max(len(row[f"{side}_input_ids"]) for row in rows for side in SIDES)


class PairRows:
    """A stream's shard transform: each kept pair one row (`hf_preference(streaming=True)`)."""

    def __init__(self, shards: int, encoder: PairEncoder):
        self.shards, self.encoder = shards, encoder

    def feed(self, position: int, example: Any, offset: int = 0) -> list[tuple[Any, tuple[int, int]]]:
        """The pair's row (nothing when it is dropped; the first drop and every doubling of the
        count said in one line, since a stream is never counted to its end)."""
        pair = self.encoder.encode(example, str(example.get(WHERE, "a streamed row")))
        if pair is None:
            self.encoder.say_dropped_so_far()
        return [(pair, (position + self.shards, 0))] if pair is not None else []

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """Nothing is held back."""
        return []


def _stream(encoder: Any, paths: list[Path], builder: str | None, shards: int, seed: int) -> Stream:
    """The pairs of the files as a `Stream` (never loaded whole; exact resume)."""
    import datasets

    parts = []
    for path in paths:
        kind = _builder(path, builder)
        parts.append(load_local(kind, [path], streaming=True).map(_Where(path, kind), with_indices=True))
    pairs = encoder()
    rows = functools.partial(PairRows, encoder=pairs)
    data = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    collate = PairCollator(_pad_id(pairs.chat.tok))
    return Stream(
        data, rows, shards=shards, seed=seed, collate_fn=collate, info={"tokenizer": pairs.chat.tok}
    )


def _encode_files(
    encoder: PairEncoder, paths: list[Path], builder: str | None
) -> list[dict[str, np.ndarray]]:
    kept = []
    for path in paths:
        kind = _builder(path, builder)
        for i, row in enumerate(load_local(kind, [path])):
            pair = encoder.encode(row, _where(path, kind, i))
            if pair is not None:
                kept.append(pair)
    return kept


def _as_dataset(rows: list[dict[str, np.ndarray]]) -> Any:
    import datasets

    if not rows:
        return None
    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]}).with_format("torch")


def hf_preference(
    data_files: Any,
    prompt_column: str = "prompt",
    chosen_column: str = "chosen",
    rejected_column: str = "rejected",
    tokenizer: str | None = None,
    chat_template: str | None = None,
    max_length: int = 1024,
    val_fraction: float = 0.1,
    validation_files: Any = None,
    split_seed: int = 0,
    builder: str | None = None,
    streaming: bool = False,
    shards: int = DEFAULT_SHARDS,
    seed: int = 0,
) -> TokenizedSplits:
    """Pairs of local JSONL / Parquet files (`builder` from the suffix) -> rows of a chosen and a
    rejected answer (see the module doc). Validation: `validation_files`, else `val_fraction` of
    the pairs (a fixed split by `split_seed`); 0: none. `streaming`: the files read as a
    `framework.data.streams.Stream` (validation only from `validation_files`)."""
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError(f"data.dataset.val_fraction={val_fraction}: must be in [0, 1)")
    tok = chat_tokenizer(tokenizer, chat_template)
    encoder = functools.partial(PairEncoder, tok, max_length, (prompt_column, chosen_column, rejected_column))
    held_out = _paths(validation_files, "validation_files") if validation_files is not None else None
    if streaming:
        valid = _stream(encoder, held_out, builder, shards, seed) if held_out is not None else None
        splits = Splits(_stream(encoder, _paths(data_files), builder, shards, seed), valid)
        return with_tokenizer(splits, tok, collate_fn=PairCollator(_pad_id(tok)))
    counted = encoder()
    pairs = _encode_files(counted, _paths(data_files), builder)
    counted.report("training " if held_out else "")
    if not pairs:
        raise ConfigError(f"data.dataset.data_files: no pair left to learn from: {counted.why()}")
    validation: list[dict[str, np.ndarray]] = []
    if held_out is not None:
        checked = encoder()
        validation = _encode_files(checked, held_out, builder)
        checked.report("validation ")
    elif val_fraction:
        order = np.random.default_rng(split_seed).permutation(len(pairs))
        chosen = set(order[: int(np.ceil(val_fraction * len(pairs)))].tolist())
        validation = [p for i, p in enumerate(pairs) if i in chosen]
        pairs = [p for i, p in enumerate(pairs) if i not in chosen]
    splits = Splits(_as_dataset(pairs), _as_dataset(validation))
    return with_tokenizer(splits, tok, collate_fn=PairCollator(_pad_id(tok)))
