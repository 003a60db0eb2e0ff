"""The label that does not count: positions labelled `IGNORE_INDEX` (-100, Hugging Face's and
torch's cross-entropy's) are left out of every loss, item count and metric of the framework
(padding, a prompt, a document's first token in a packed block). Its one owner."""

from __future__ import annotations

from collections.abc import Sequence

IGNORE_INDEX = -100


def counts_nothing(labels: Sequence[int], shifted: bool = True) -> bool:
    """True when no position of `labels` counts (`shifted`: as a causal LM reads them, the first
    label predicting nothing)."""
    return all(int(label) == IGNORE_INDEX for label in labels[1 if shifted else 0 :])
