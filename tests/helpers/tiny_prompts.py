"""Prompts over the tiny chat tokenizer's words (`tests.helpers.tiny_chat`) for GRPO tests, and the
rule rewards shipped with `experiment=grpo_tiny` (`examples/tiny_chat/rewards.py`): `meow_share`
rewards the share of a completion's words that are "meow".

    from tests.helpers.tiny_prompts import PROMPTS, write_prompts_jsonl
    data = write_prompts_jsonl(tmp_path / "prompts.jsonl")   # 32 {prompt, animal} rows
    # ... +objective=grpo "objective.reward_funcs=[examples.tiny_chat.rewards.meow_share]"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_QUESTIONS = [
    "what do cats say ?",
    "say hello .",
    "count to three .",
    "is the sky blue ?",
    "name a red fruit .",
    "what is two plus two ?",
    "and a yellow one ?",
    "say it twice .",
    "thank you .",
    "and at night ?",
    "what is the capital of france ?",
    "which is bigger , a cat or a dog ?",
    "say hello twice .",
    "is a banana yellow ?",
    "what do dogs say ?",
    "count to two .",
]
# Text prompts and chat prompts, each with a column the rewards may read.
PROMPTS: list[dict[str, Any]] = [
    *({"prompt": q, "animal": "cat"} for q in _QUESTIONS),
    *({"prompt": [{"role": "user", "content": q}], "animal": "dog"} for q in _QUESTIONS),
]


from examples.tiny_chat.rewards import meow_share, says_cat_for_cats  # noqa: E402,F401 - the shipped rewards


def write_prompts_jsonl(path: str | Path, prompts: list[dict[str, Any]] | None = None) -> Path:
    """A JSONL file, one prompt row per line."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in (prompts if prompts is not None else PROMPTS)))
    return path


def cat_words(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """A dense rule reward of the tests' own: the share of a completion's words that are "cat" or
    "cats"."""
    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[0]["content"]
        words = text.split()
        out.append(sum(w in ("cat", "cats") for w in words) / len(words) if words else 0.0)
    return out


def raises(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """A reward function with a bug."""
    raise KeyError("solution")


def too_few(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """A reward function that forgets a completion."""
    return [0.0] * (len(completions) - 1)


def not_a_number(prompts: list[Any], completions: list[Any], **columns: Any) -> list[Any]:
    """A reward function that returns text."""
    return ["good"] * len(completions)
