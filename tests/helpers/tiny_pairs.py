"""Preference pairs over the tiny chat tokenizer's words (`tests.helpers.tiny_chat`), made locally.

from tests.helpers.tiny_pairs import PAIRS, write_pairs_jsonl

data = write_pairs_jsonl(tmp_path / "pairs.jsonl")   # 8 {prompt, chosen, rejected} rows
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Prompts as strings and as chat messages; answers as strings and as assistant messages.
PAIRS: list[dict[str, Any]] = [
    {"prompt": "what is the capital of france ?", "chosen": "the capital of france is paris .", "rejected": "a banana is yellow ."},
    {"prompt": "name a red fruit .", "chosen": "an apple is a red fruit .", "rejected": "cats say meow ."},
    {"prompt": "count to three .", "chosen": "one two three .", "rejected": "one two ."},
    {"prompt": "is the sky blue ?", "chosen": "yes , on a clear day .", "rejected": "it is dark at night ."},
    {
        "prompt": [{"role": "system", "content": "answer in few words ."}, {"role": "user", "content": "what do cats say ?"}],
        "chosen": [{"role": "assistant", "content": "cats say meow ."}],
        "rejected": [{"role": "assistant", "content": "hello hello !"}],
    },
    {"prompt": "say hello .", "chosen": "hello !", "rejected": "you are welcome ."},
    {
        "prompt": [
            {"role": "user", "content": "what is two plus two ?"},
            {"role": "assistant", "content": "two plus two is four ."},
            {"role": "user", "content": "thank you ."},
        ],
        "chosen": "you are welcome .",
        "rejected": "a dog is usually bigger than a cat .",
    },
    {"prompt": "which is bigger , a cat or a dog ?", "chosen": "a dog is usually bigger than a cat .", "rejected": "one ."},
]  # fmt: skip


def write_pairs_jsonl(path: str | Path, pairs: list[dict[str, Any]] | None = None) -> Path:
    """A JSONL file, one `{prompt, chosen, rejected}` pair per line."""
    path = Path(path)
    path.write_text("".join(json.dumps(pair) + "\n" for pair in (pairs if pairs is not None else PAIRS)))
    return path
