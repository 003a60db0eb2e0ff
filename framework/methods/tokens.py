"""What methods that score tokens share: their options (`TokenScoring`), per-row statistics of a
causal LM's answer tokens, and a meter of means over a logging window.

A causal LM's position t scores label t + 1; a position counts when that label is not -100
(`framework.data.labels`). `answer_stats` gives, per row, the sum of log p(label) over the
counted positions (the answer's log-probability) and their number, computed in float32 whatever
the logits' dtype, as log p = logit - logsumexp(logits) (no second vocabulary-sized tensor);
with `extras`, also what TRL logs of them: the mean logit of each counted position (summed) and
how many labels are the model's first choice.

`score_answers` computes the same statistics from the model itself: by default through its output
head in chunks of positions, never holding the batch's logits (`framework.methods.chunked`;
equal to the logits path to float rounding), or from its logits with `chunked_loss=False`, for a
model or head the chunked path does not know, and for a run that reads another output
(`trainer.output_key`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from framework.data.labels import IGNORE_INDEX
from framework.data.outputs import logits_of
from framework.errors import ConfigError
from framework.methods import chunked


@dataclass(kw_only=True)
class TokenScoring:
    """The options of every method that scores tokens (SFT, DPO, SimPO, ORPO, GRPO)."""

    # true: the LM head applied to the counted positions in chunks, the batch's logits never held
    # (same loss and gradients); false: scored from the model's logits
    chunked_loss: bool = True
    chunk_size: int = chunked.CHUNK_SIZE  # positions per chunk (a chunk holds chunk_size x vocabulary logits)

    def __post_init__(self) -> None:
        if int(self.chunk_size) < 1:
            raise ConfigError.about(
                type(self).__name__.removesuffix("Config"), "chunk_size", self.chunk_size, "must be >= 1"
            )

    @property
    def chunking(self) -> int | None:
        """Positions per chunk of the chunked path, None for the logits path."""
        return int(self.chunk_size) if self.chunked_loss else None


@dataclass
class AnswerStats:
    """Per-row statistics of the counted positions (see the module doc); `mean_logits` and
    `correct` are None unless asked for."""

    logps: torch.Tensor  # sum of log p(label) per row
    tokens: torch.Tensor  # counted positions per row
    mean_logits: torch.Tensor | None = None  # sum over counted positions of the mean logit
    correct: torch.Tensor | None = None  # counted positions whose label is the argmax

    def average(self) -> torch.Tensor:
        """The mean log-probability per counted token of each row."""
        return self.logps / self.tokens.clamp_min(1)


def answer_stats(logits: torch.Tensor, labels: torch.Tensor, extras: bool = False) -> AnswerStats:
    """`AnswerStats` of a batch of rows (logits `[rows, positions, vocab]`, labels `[rows, positions]`)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    counted = labels != IGNORE_INDEX
    picked = torch.gather(logits, 2, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    stats = AnswerStats((picked * counted).sum(-1), counted.sum(-1))
    if extras:
        with torch.no_grad():
            stats.mean_logits = (logits.mean(-1) * counted).sum(-1)
            stats.correct = ((logits.argmax(-1) == labels) & counted).sum(-1)
    return stats


def score_answers(
    model: Any,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    chunk_size: int | None = None,
    extras: bool = False,
    output_key: str | None = None,
) -> AnswerStats:
    """`AnswerStats` of `model` (a DeepSpeed engine or a module) on a batch of `inputs` scored
    against `labels`: through its head in chunks of `chunk_size` positions where it has one the
    chunked path knows, else (and with `chunk_size` None, or an `output_key` other than logits)
    from its logits."""
    if chunk_size is not None and output_key in (None, "logits"):
        scored = chunked.fused_scores(model, inputs, labels, chunk_size)
        if scored is not None:
            stats = AnswerStats(scored.logps.sum(-1), scored.counted.sum(-1))
            if extras:
                assert scored.mean_logits is not None and scored.correct is not None
                stats.mean_logits, stats.correct = scored.mean_logits.sum(-1), scored.correct.sum(-1)
            return stats
    return answer_stats(logits_of(model(**inputs), output_key), labels, extras)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per row: the sum (or, `average`, the mean) over the answer tokens of log p(label)."""
    stats = answer_stats(logits, labels)
    return stats.average() if average else stats.logps


class Meter:
    """Means of named quantities since the last read, each over its own count (pairs, tokens),
    kept on the device (no host sync per step) and summed over ranks in one all-reduce when read.
    Every rank adds the same names in the same order."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.sums: torch.Tensor | None = None  # [2, len(names)]: totals, counts

    def add(self, values: dict[str, tuple[Any, Any]]) -> None:
        """Add `{name: (total, count)}` for some of the meter's names (the others: nothing)."""
        device = next((v[0].device for v in values.values() if isinstance(v[0], torch.Tensor)), None)
        nothing = (0.0, 0.0)

        def as_scalar(value: Any) -> torch.Tensor:
            value = value.detach() if isinstance(value, torch.Tensor) else value
            return torch.as_tensor(value, dtype=torch.float64, device=device).reshape(())

        totals = torch.stack([as_scalar(values.get(name, nothing)[0]) for name in self.names])
        counts = torch.stack([as_scalar(values.get(name, nothing)[1]) for name in self.names])
        row = torch.stack([totals, counts])
        self.sums = row if self.sums is None else self.sums + row

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last read, on the CPU (a checkpoint between logging points)."""
        return {"names": list(self.names), "sums": None if self.sums is None else self.sums.detach().cpu()}

    def load_sums(self, states: list[dict[str, Any]], device: torch.device | None = None) -> None:
        """The sum of `states` (`state_dict`s of this rank, or on another number of ranks every
        saved rank's given to one rank) as this meter's: reads over all ranks then see the saved
        window's totals whatever the layout."""
        saved = [
            s["sums"]
            for s in states
            if s.get("sums") is not None and list(s.get("names", [])) == list(self.names)
        ]
        self.sums = torch.stack(saved).sum(0).to(device or "cpu", torch.float64) if saved else None

    def read(self, device: torch.device | None = None) -> dict[str, float]:
        """Means over every rank's items since the last read (collective: every rank calls it);
        a quantity with no item is left out."""
        sums = self.sums if self.sums is not None else torch.zeros(2, len(self.names), dtype=torch.float64)
        sums = sums.to(device or sums.device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(sums)
        self.sums = None
        totals, counts = sums.tolist()
        return {name: total / count for name, total, count in zip(self.names, totals, counts) if count}
