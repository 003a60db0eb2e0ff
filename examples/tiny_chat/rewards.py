"""Rule rewards for `experiment=grpo_tiny` (GRPO on the tiny chat vocabulary), with TRL's signature
`f(prompts, completions, **columns) -> list[float | None]`.

`meow_share` rewards the share of a completion's words that are "meow": about 1 in 70 by chance
with the tiny vocabulary, and a policy learns to say it in a few dozen steps.
"""

from typing import Any


def _text(completion: Any) -> str:
    """A completion as text: chat prompts' completions are one assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def meow_share(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """The share of the completion's words that are "meow" (0 for an empty completion)."""
    out = []
    for completion in completions:
        words = _text(completion).split()
        out.append(sum(w == "meow" for w in words) / len(words) if words else 0.0)
    return out


def says_cat_for_cats(
    prompts: list[Any], completions: list[Any], animal: list[str], **_: Any
) -> list[float | None]:
    """1 when a cat prompt's completion says "cats", 0 when it does not; None (not applicable) for
    the other prompts."""
    return [None if a != "cat" else float("cats" in _text(c).split()) for c, a in zip(completions, animal)]
