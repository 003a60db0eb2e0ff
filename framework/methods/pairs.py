"""What preference methods share: batches of pairs (`data=hf_preference`), one forward pass for
both answers, and the metrics TRL logs for them.

Chosen and rejected answers go through the model in one forward pass (concatenated on the batch
dimension, padded to one length by `PairCollator`); an answer's log-probability is the sum (or,
for methods that average, the mean) over its answer tokens of log p(token | what precedes it)
(`framework.methods.tokens`: by default through the model's head in chunks, its logits never
held; `chunked_loss=False` scores them from the logits). Every training micro-batch holds the
same number of pairs, so a loss that is a mean over a micro-batch's pairs becomes, through
DeepSpeed's average over accumulation steps and data-parallel ranks, the mean over the global
batch's pairs on every layout. A term that averages over tokens instead (ORPO's NLL) asks for the framework's item
weight (`Method.items`).

Each logged step gets TRL's metrics over the pairs since the last logging point, summed over
ranks: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected (the log-probabilities the loss uses), logits/chosen, logits/rejected (the mean
logit over the answers' tokens), and what the method adds; validation reports the same as
val_... A checkpoint keeps the window's sums, so a resumed run logs what the uninterrupted one
logs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from framework.data.outputs import takes_use_cache
from framework.errors import ConfigError
from framework.methods.base import Method
from framework.methods.tokens import AnswerStats, Meter, score_answers

PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)


def concatenated(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of the chosen rows, then the rejected ones."""
    try:
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    except (KeyError, TypeError) as exc:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ConfigError(
            f"a preference method needs batches of pairs (chosen_/rejected_ input_ids, attention_mask, "
            f"labels), got {keys}: use data=hf_preference"
        ) from exc
    return ids, mask, labels


def pair_stats(
    model: Any,
    batch: dict[str, Any],
    output_key: str | None = None,
    no_cache: bool = True,
    extras: bool = False,
    chunk_size: int | None = None,
) -> tuple[AnswerStats, AnswerStats]:
    """(chosen, rejected) `AnswerStats` of `model` from one forward pass (`no_cache`: a Hugging
    Face model is asked for no key/value cache; `extras`: the logits' and accuracy's sums too;
    `chunk_size`: through the head in chunks of that many positions, see `score_answers`)."""
    ids, mask, labels = concatenated(batch)
    inputs = {"input_ids": ids, "attention_mask": mask, **({"use_cache": False} if no_cache else {})}
    stats = score_answers(model, inputs, labels, chunk_size, extras, output_key)
    rows = ids.shape[0] // 2

    def half(part: slice) -> AnswerStats:
        extra = [None if v is None else v[part] for v in (stats.mean_logits, stats.correct)]
        return AnswerStats(stats.logps[part], stats.tokens[part], *extra)

    return half(slice(0, rows)), half(slice(rows, None))


def policy_stats(
    engine: Any, batch: dict[str, Any], extras: bool = True, chunk_size: int | None = None
) -> tuple[AnswerStats, AnswerStats]:
    """`pair_stats` of the model the engine trains."""
    return pair_stats(
        engine.model, batch, engine.output_key, takes_use_cache(engine.module), extras, chunk_size
    )


def pair_metrics(
    chosen: AnswerStats,
    rejected: AnswerStats,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> dict[str, tuple[torch.Tensor, Any]]:
    """TRL's pair metrics (`PAIR_METRICS`) of a batch as (total, count) for a `Meter`."""
    pairs = chosen_rewards.numel()
    values = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": chosen_logps.detach().sum(),
        "logps/rejected": rejected_logps.detach().sum(),
    }
    out: dict[str, tuple[torch.Tensor, Any]] = {name: (value, pairs) for name, value in values.items()}
    for name, stats in (("logits/chosen", chosen), ("logits/rejected", rejected)):
        assert stats.mean_logits is not None
        out[name] = (stats.mean_logits.sum(), stats.tokens.sum())
    return out


class PairMethod(Method):
    """A method over batches of pairs: `loss(engine, batch, weight) -> (loss, metrics)` is its
    own; the meters, validation and checkpoint state are shared (see the module doc)."""

    metric_names: ClassVar[tuple[str, ...]] = PAIR_METRICS

    def __init__(self, config: Any = None, **options: Any):
        super().__init__(config, **options)
        self.meter = Meter(self.metric_names)  # training pairs since the last logging point
        self.eval_meter = Meter(self.metric_names)  # validation pairs of the evaluation under way

    def loss(
        self, engine: Any, batch: dict[str, Any], weight: Any = None
    ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, Any]]]:
        """(the micro-batch's loss, its metrics as (total, count))."""
        raise NotImplementedError

    def policy(self, engine: Any, batch: dict[str, Any]) -> tuple[AnswerStats, AnswerStats]:
        """(chosen, rejected) `AnswerStats` of the trained model, scored as the options say."""
        return policy_stats(engine, batch, chunk_size=self.config.chunking)

    def __call__(self, engine: Any, batch: Any, weight: Any = None) -> torch.Tensor:
        """The micro-batch's loss; its metrics join the training window."""
        loss, metrics = self.loss(engine, batch, weight)
        self.meter.add(metrics)
        return loss

    def eval_step(self, engine: Any, batch: Any) -> torch.Tensor:
        """The validation loss of a batch; its metrics join the validation meter."""
        loss, metrics = self.loss(engine, batch, None)
        self.eval_meter.add(metrics)
        return loss

    def step_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """The metrics since the last logging point (collective; the loop calls it)."""
        return self.meter.read(device)

    def eval_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """The metrics of the validation pairs since the last call (logged as val_...)."""
        return self.eval_meter.read(device)

    def step_state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the sums of the steps since the last logging point."""
        return {"meter": self.meter.state_dict()}

    def load_step_state(self, states: list[dict[str, Any]], device: torch.device | None = None) -> None:
        """Put back `step_state`s (this rank's; on another number of ranks every saved rank's on
        one rank, none on the others)."""
        self.meter.load_sums([s["meter"] for s in states if "meter" in s], device)
