"""Prompts for online methods (GRPO, `+objective=grpo`) from your own JSONL / JSON / Parquet files.

    python train.py model=hf_causal_lm model.path=DIR data=hf_prompts \\
        data.dataset.data_files=prompts.jsonl +objective=grpo "objective.reward_funcs=[my.reward]"

Each row holds a `prompt` (`prompt_column`): a string, used as plain text as TRL uses it (no
chat template), or a list of chat messages, rendered by the tokenizer's chat template with the
generation prompt. The row's other columns travel with it to the reward functions (a `solution`,
a unit test, ...). A prompt longer than `max_prompt_length` tokens keeps its last ones (counted,
in one line). Rows are `{prompt_ids, index, prompt, <other columns>}`, where `index` is the row's
place in the files (a completion's random draws are seeded by it, so they do not depend on the
ranks); `PromptCollator` left-pads a batch's prompts. The data carries its tokenizer
(`PromptRows.tokenizer`, a stream's `info`), which the method decodes completions with.
`streaming=True` reads the files as a `framework.data.streams.Stream` (never loaded whole, exact
resume; validation from `validation_files` only).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from framework.data.datasets.classification import Splits
from framework.data.datasets.counted import Counted
from framework.data.datasets.hf import TokenizedSplits, with_tokenizer
from framework.data.datasets.render import chat_tokenizer
from framework.data.datasets.sources import WHERE, data_paths, rows, streamed
from framework.data.streams import DEFAULT_SHARDS, Stream
from framework.errors import ConfigError


class PromptEncoder(Counted):
    """One row -> its prompt's token ids (the last `max_length` when longer: counted)."""

    unit, cut = "prompts", ""

    def __init__(self, tokenizer: Any, column: str, max_length: int):
        if int(max_length) < 1:
            raise ConfigError.about("hf_prompts", "max_prompt_length", max_length, "at least 1 token")
        self.tok, self.column, self.max_length = tokenizer, column, int(max_length)
        super().__init__()

    def encode(self, row: dict[str, Any], where: str, index: int) -> dict[str, Any]:
        """The row with its prompt's ids and its `index`."""
        prompt = row.get(self.column)
        if prompt is None:
            present = sorted(k for k, v in row.items() if v is not None and k != WHERE)
            raise ConfigError(
                f"{where}: no '{self.column}' in the row (it has {present}); data.dataset.prompt_column names it"
            )
        ids = self._ids(prompt, where)
        self.seen += 1
        if len(ids) > self.max_length:
            self.truncated += 1
            ids = ids[-self.max_length :]
        others = {k: v for k, v in row.items() if k not in (self.column, WHERE)}
        return {**others, "prompt": prompt, "prompt_ids": np.asarray(ids, dtype=np.int64), "index": index}

    def _ids(self, prompt: Any, where: str) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tok(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            try:
                out = self.tok.apply_chat_template(
                    prompt, tokenize=True, add_generation_prompt=True, return_dict=True
                )
            except Exception as exc:  # the template's own checks
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(f"{where}: the chat template cannot render this prompt: {first}") from exc
            return list(out["input_ids"])
        raise ConfigError(
            f"{where}: '{self.column}' must be a string or a list of {{role, content}} messages"
        )


class PromptRows(torch.utils.data.Dataset):
    """Encoded prompts (rows of `PromptEncoder.encode`), with the tokenizer that made them."""

    def __init__(self, items: list[dict[str, Any]], tokenizer: Any):
        self.items, self.tokenizer = items, tokenizer

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


class PromptCollator:
    """A batch of prompt rows: `prompt_ids` left-padded with `pad_id` and its `prompt_mask`,
    `index` as a tensor, every other column a list."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(item["prompt_ids"]) for item in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, item in enumerate(items):
            row = torch.as_tensor(item["prompt_ids"], dtype=torch.long)
            ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
        out: dict[str, Any] = {"prompt_ids": ids, "prompt_mask": mask}
        out["index"] = torch.tensor([int(item["index"]) for item in items], dtype=torch.long)
        for key in items[0]:
            if key not in out:
                out[key] = [item.get(key) for item in items]
        return out


class PromptStreamRows:
    """A stream's shard transform: each row one prompt (its index from where it was read)."""

    def __init__(self, shards: int, encoder: PromptEncoder):
        self.shards, self.encoder = shards, encoder

    def feed(self, position: int, example: Any, offset: int = 0) -> list[tuple[Any, tuple[int, int]]]:
        """The prompt's row."""
        where = str(example.get(WHERE, "a streamed row"))
        index = int.from_bytes(hashlib.blake2b(where.encode(), digest_size=7).digest(), "little")
        return [(self.encoder.encode(example, where, index), (position + self.shards, 0))]

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """Nothing is held back."""
        return []


def _encode(
    encoder: PromptEncoder, paths: list[Path], builder: str | None, start: int = 0
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for path in paths:
        for at, row, _ in rows(path, builder):
            items.append(encoder.encode(row, at, start + len(items)))
    return items


def _pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def hf_prompts(
    data_files: Any,
    prompt_column: str = "prompt",
    tokenizer: str | None = None,
    chat_template: str | None = None,
    max_prompt_length: int = 512,
    val_fraction: float = 0.0,
    validation_files: Any = None,
    split_seed: int = 0,
    builder: str | None = None,
    streaming: bool = False,
    shards: int = DEFAULT_SHARDS,
    seed: int = 0,
) -> TokenizedSplits:
    """Prompts of local files (see the module doc). Validation: `validation_files`, else
    `val_fraction` of the prompts (a fixed split by `split_seed`); 0: none."""
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError.about("hf_prompts", "val_fraction", val_fraction, "must be in [0, 1)")
    tok = chat_tokenizer(tokenizer, chat_template)
    encoder = functools.partial(PromptEncoder, tok, prompt_column, max_prompt_length)
    held_out = data_paths(validation_files, "validation_files") if validation_files is not None else None
    collate = PromptCollator(_pad_id(tok))
    if streaming:

        def stream(paths: list[Path]) -> Stream:
            transform = functools.partial(PromptStreamRows, encoder=encoder())
            return Stream(
                streamed(paths, builder),
                transform,
                shards=shards,
                seed=seed,
                collate_fn=collate,
                info={"tokenizer": tok},
            )

        valid = stream(held_out) if held_out is not None else None
        return with_tokenizer(Splits(stream(data_paths(data_files)), valid), tok, collate_fn=collate)
    counted = encoder()
    items = _encode(counted, data_paths(data_files), builder)
    counted.report("")
    if not items:
        raise ConfigError("data.dataset.data_files: no prompt in the files")
    validation: list[dict[str, Any]] = []
    if held_out is not None:
        validation = _encode(encoder(), held_out, builder, start=len(items))
    elif val_fraction:
        order = np.random.default_rng(split_seed).permutation(len(items))
        chosen = set(order[: int(np.ceil(val_fraction * len(items)))].tolist())
        validation = [p for i, p in enumerate(items) if i in chosen]
        items = [p for i, p in enumerate(items) if i not in chosen]
    valid_rows = PromptRows(validation, tok) if validation else None
    return with_tokenizer(Splits(PromptRows(items, tok), valid_rows), tok, collate_fn=collate)
