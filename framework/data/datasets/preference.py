"""Preference pairs from your own JSONL / JSON / Parquet files, for DPO (`+objective=dpo`).

    python train.py model=hf_causal_lm model.path=DIR data=hf_preference \\
        data.dataset.data_files=pairs.jsonl +objective=dpo

Each row holds `chosen` and `rejected` answers and a `prompt`, or no prompt: then the longest
common beginning of the two is the prompt (TRL's implicit prompt; said in one line per file,
`framework.data.datasets.formats`). A pair of strings (prompt too) is plain text, as TRL takes
it: the tokenizer's tokens of prompt + answer (+ end-of-sequence), no chat template. A pair with
chat messages goes through the tokenizer's chat template (a string prompt there is one user
message, a string answer one assistant message). Either way each answer is tokenized as TRL's
`DPOTrainer` does (`framework.data.datasets.answers`): the prompt alone, and prompt + answer
whole; the answer's tokens, its labels, are those after the prompt's (-100 on the prompt).
`completion_tokens=markers` keeps only what the template's generation markers mark there.

An answer longer than `max_length` tokens is cut there (counted, in one line); a pair with an
answer left with no label, or whose chosen and rejected are the same tokens (nothing to prefer: a
zero gradient), is dropped (counted, in one line).

Rows are `{chosen_input_ids, chosen_labels, chosen_attention_mask, rejected_input_ids, ...}`;
`PairCollator` pads a batch's chosen and rejected rows to one length (the DPO step runs them in
one forward pass). A file's rows are rendered once and kept (`cache`). With `streaming=True` the
files are read as a `framework.data.streams.Stream` (never loaded whole, exact resume); reference
log-probabilities cannot be stored with a stream (`objective.precompute_reference`), a frozen copy
or adapters give them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from framework.data.datasets import answers
from framework.data.datasets.cache import encoded_splits, fingerprint, tokenizer_fingerprint
from framework.data.datasets.chat import _pad_id
from framework.data.datasets.classification import Splits
from framework.data.datasets.counted import Counted, say
from framework.data.datasets.formats import ChatFormat, Reading, sharegpt_keys
from framework.data.datasets.hf import TokenizedSplits, with_tokenizer
from framework.data.datasets.render import ChatEncoder, chat_tokenizer
from framework.data.datasets.sources import WHERE, data_paths, first_row, streamed
from framework.data.datasets.text_classification import PadCollator
from framework.data.labels import IGNORE_INDEX, counts_nothing
from framework.data.streams import DEFAULT_SHARDS, Stream
from framework.errors import ConfigError

SIDES = ("chosen", "rejected")
SAME = "same"  # the reason a pair whose answers are the same tokens is dropped


class PairFormat:
    """How the rows of a pairs file become (prompt, chosen, rejected): strings (plain text) or
    chat messages; without a prompt, the longest common beginning of chosen and rejected (as TRL's
    `extract_prompt`: each answer keeps at least one message, or character)."""

    def __init__(self, reading: Reading, columns: tuple[str, str, str], row: dict[str, Any] | None = None):
        self.reading, self.columns = reading, columns
        first = next((m for c in columns for m in _as_list((row or {}).get(c)) if isinstance(m, dict)), {})
        self.chat = ChatFormat("sharegpt" if sharegpt_keys(first, reading) else "messages", reading)
        self.plain = row is not None and all(isinstance(row.get(c), (str, type(None))) for c in columns)

    def describe(self, path: Any, row: dict[str, Any]) -> str:
        """The one line that says how a file is read."""
        prompt, chosen, rejected = self.columns
        shape = f"{prompt}/{chosen}/{rejected}"
        if row.get(prompt) is None:
            shape = f"{chosen}/{rejected}, the prompt their common beginning"
        kind = (
            "plain text, no template"
            if self.plain
            else f"chat messages, {self.chat.role_key}/{self.chat.content_key}"
        )
        return f"data: preference pairs ({shape}; {kind}) in {path}"

    def key(self) -> str:
        """What the format is, for a cache key."""
        return json.dumps([list(self.columns), self.chat.key()])

    def parts(self, row: dict[str, Any], where: str) -> tuple[Any, Any, Any]:
        """(prompt, chosen, rejected): three strings, or three lists of messages."""
        prompt_key, chosen_key, rejected_key = self.columns
        prompt, chosen, rejected = (row.get(k) for k in self.columns)
        if chosen is None or rejected is None:
            present = sorted(k for k, v in row.items() if v is not None and not k.startswith("__"))
            raise ConfigError(
                f"{where}: no '{chosen_key if chosen is None else rejected_key}' in the row (it has {present}); a "
                "pair needs chosen and rejected (data.dataset.chosen_column / rejected_column name them)"
            )
        if all(isinstance(v, str) for v in (chosen, rejected)) and isinstance(prompt, (str, type(None))):
            return (prompt, chosen, rejected) if prompt is not None else implicit_prompt(chosen, rejected)
        chosen = self.chat.as_messages(chosen, "assistant", where, chosen_key)
        rejected = self.chat.as_messages(rejected, "assistant", where, rejected_key)
        if prompt is None:
            return implicit_prompt(chosen, rejected)
        return self.chat.as_messages(prompt, "user", where, prompt_key), chosen, rejected


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of two strings or message lists that begin alike (TRL's
    `extract_prompt`): the prompt is their common beginning, each answer keeps at least one
    element, and a space before the first differing character goes with the answers."""
    n = min(len(chosen), len(rejected))
    for d in range(n):
        if chosen[d] != rejected[d]:
            if isinstance(chosen, str) and d > 0 and chosen[d - 1] == " ":
                d -= 1
            break
    else:
        d = max(0, n - 1)
    return chosen[:d], chosen[d:], rejected[d:]


class PairEncoder(Counted):
    """One row -> the chosen and rejected rows of arrays, or None for a dropped pair. Counts
    what it cut and dropped (`seen`, `truncated`, `drops`)."""

    unit, cut = "pairs", "answers "

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        columns: tuple[str, str, str],
        reading: Reading | None = None,
        completion_tokens: str = "rendered",
    ):
        self.chat = ChatEncoder(tokenizer, None, max_length, False, reading, completion_tokens)
        self.columns, self.max_length = (columns[0], columns[1], columns[2]), int(max_length)
        self.format = PairFormat(self.chat.reading, self.columns)
        super().__init__()

    def read_as(self, where: str, row: dict[str, Any], path: Path) -> str:
        """Read the rows of `path` as its first row `row` says; the line that says so."""
        self.format = PairFormat(self.chat.reading, self.columns, row)
        return self.format.describe(path, row)

    def fingerprint(self) -> str:
        """What the rows depend on besides a file's bytes (the key of their cache)."""
        return fingerprint(
            "pairs",
            self.format.key(),
            self.max_length,
            self.chat.completion_tokens,
            tokenizer_fingerprint(self.chat.tok),
        )

    def encode_row(self, row: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
        """The pair of `row` (the file and line `where`) as a row of arrays."""
        return self.encode(row, where)

    def encode(self, row: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
        """The pair of `row` (the file and line `where`) as a row of arrays, None when dropped."""
        prompt, chosen, rejected = self.format.parts(row, where)
        self.seen += 1
        if isinstance(prompt, str):
            sides = answers.plain(self.chat.tok, prompt, [chosen, rejected])
        else:
            sides = answers.templated(self.chat, prompt, [chosen, rejected], where, self.chat.markers)
        out: dict[str, np.ndarray] = {}
        for side, (ids, mask) in zip(SIDES, sides):
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
            if len(ids) > self.max_length:
                self.truncated += 1
                ids, labels = ids[: self.max_length], labels[: self.max_length]
            if counts_nothing(labels):
                self.drop()
                return None
            out[f"{side}_input_ids"] = np.asarray(ids, dtype=np.int64)
            out[f"{side}_labels"] = np.asarray(labels, dtype=np.int64)
            out[f"{side}_attention_mask"] = np.ones(len(ids), dtype=np.int64)
        if all(np.array_equal(out[f"chosen_{k}"], out[f"rejected_{k}"]) for k in ("input_ids", "labels")):
            self.drop(SAME)
            return None
        return out

    def why(self, reason: str = "") -> str:
        """Why a pair is dropped, in words."""
        if reason == SAME:
            return "chosen and rejected are the same tokens (nothing to prefer); fix or remove them"
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
        drops = dict(self.encoder.drops)
        pair = self.encoder.encode(example, str(example.get(WHERE, "a streamed row")))
        if pair is None:
            reason = next(r for r, n in self.encoder.drops.items() if n != drops.get(r, 0))
            self.encoder.say_dropped_so_far(reason)
        return [(pair, (position + self.shards, 0))] if pair is not None else []

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """Nothing is held back."""
        return []


def _stream(encoder: Any, paths: list[Path], builder: str | None, shards: int, seed: int) -> Stream:
    """The pairs of the files as a `Stream` (never loaded whole; exact resume), each file's shape
    said in one line."""
    pairs = encoder()
    for path in paths:
        say(pairs.read_as(*first_row(path, builder), path))
    rows = functools.partial(PairRows, encoder=pairs)
    collate = PairCollator(_pad_id(pairs.chat.tok))
    return Stream(
        streamed(paths, builder),
        rows,
        shards=shards,
        seed=seed,
        collate_fn=collate,
        info={"tokenizer": pairs.chat.tok},
    )


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
    message_keys: Any = None,
    roles: Any = None,
    completion_tokens: str = "rendered",
    cache: Any = True,
) -> TokenizedSplits:
    """Pairs of local JSONL / JSON / Parquet files (`builder` from the suffix) -> rows of a
    chosen and a rejected answer (see the module doc). `message_keys`, `roles`: how messages are
    read (`framework.data.datasets.formats`); `completion_tokens`: `rendered` (TRL's) or
    `markers`; `cache`: true, a directory, or false (`framework.data.datasets.cache`). Validation:
    `validation_files`, else `val_fraction` of the pairs (a fixed split by `split_seed`); 0: none.
    `streaming`: the files read as a `framework.data.streams.Stream` (validation only from
    `validation_files`)."""
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError(f"data.dataset.val_fraction={val_fraction}: must be in [0, 1)")
    tok = chat_tokenizer(tokenizer, chat_template)
    reading = Reading.of(message_keys=message_keys, roles=roles)
    columns = (prompt_column, chosen_column, rejected_column)
    encoder = functools.partial(PairEncoder, tok, max_length, columns, reading, completion_tokens)
    held_out = data_paths(validation_files, "validation_files") if validation_files is not None else None
    if streaming:
        valid = _stream(encoder, held_out, builder, shards, seed) if held_out is not None else None
        splits = Splits(_stream(encoder, data_paths(data_files), builder, shards, seed), valid)
        return with_tokenizer(splits, tok, collate_fn=PairCollator(_pad_id(tok)))
    pairs, validation = encoded_splits(
        encoder, data_paths(data_files), held_out, builder, cache, val_fraction, split_seed
    )
    splits = Splits(_as_dataset(pairs), _as_dataset(validation))
    return with_tokenizer(splits, tok, collate_fn=PairCollator(_pad_id(tok)))
