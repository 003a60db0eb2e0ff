"""Supervised fine-tuning of a causal LM: the mean negative log-likelihood over the labelled
tokens of the global batch (with `data=hf_chat`, the assistant's tokens: the data labels them,
-100 elsewhere), as TRL's `SFTTrainer` computes it.

    python train.py model=hf_causal_lm model.path=DIR data=hf_chat +objective=sft
    Engine(model, optimizer=..., train_step=SFT())

A row is `{input_ids, attention_mask, labels[, position_ids]}`; position t scores label t + 1
(`framework.methods.tokens`). The loss is a mean over the tokens of the whole global batch, not
of each micro-batch: the framework counts them before the step (`Method.items`), so the update
is the same on every layout. Logged beside the loss, with TRL's names: `mean_token_accuracy`
(the share of labelled tokens the model ranks first, over the window) and `num_tokens` (the
input tokens trained so far, all ranks; kept by checkpoints).

The model's logits are never held: its output head scores the labelled positions in chunks
(`chunked_loss`, `chunk_size`: `framework.methods.tokens.TokenScoring`), which is what makes this
the memory-lean way to fine-tune; `loss=model` (the model's own loss from `labels=`) computes
the same mean over the batch's full logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from framework.data.labels import IGNORE_INDEX
from framework.data.outputs import takes_use_cache
from framework.errors import ConfigError
from framework.methods.base import Method
from framework.methods.tokens import Meter, TokenScoring, score_answers


@dataclass
class SFTConfig(TokenScoring):
    """SFT's options: how tokens are scored (what is labelled is the data's choice:
    `data.dataset.train_on_prompt`)."""


class SFT(Method):
    """Supervised fine-tuning (see the module doc)."""

    name = "sft"
    Config = SFTConfig

    def __init__(self, config: Any = None, **options: Any):
        super().__init__(config, **options)
        self.meter = Meter(("mean_token_accuracy",))
        self.eval_meter = Meter(("mean_token_accuracy",))
        self.tokens_seen: torch.Tensor | None = None  # this rank's input tokens so far

    def items(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The labelled tokens the loss averages over (labels shifted by one)."""
        return (_labels(batch)[:, 1:] != IGNORE_INDEX).sum().to(torch.float64)

    def nll(self, engine: Any, batch: Mapping[str, Any], meter: Meter) -> torch.Tensor:
        """The mean negative log-likelihood over the batch's labelled tokens; accuracy to `meter`."""
        labels = _labels(batch)
        inputs = {k: v for k, v in batch.items() if k != engine.label_key}
        if takes_use_cache(engine.module):
            inputs.setdefault("use_cache", False)
        stats = score_answers(engine.model, inputs, labels, self.config.chunking, True, engine.output_key)
        tokens = stats.tokens.sum()
        assert stats.correct is not None
        meter.add({"mean_token_accuracy": (stats.correct.sum(), tokens)})
        return -stats.logps.sum() / tokens.clamp_min(1)

    def __call__(self, engine: Any, batch: Any, weight: Any = None) -> torch.Tensor:
        """The micro-batch's loss, times `weight` (its share of the global batch's tokens)."""
        loss = self.nll(engine, batch, self.meter)
        mask = batch.get("attention_mask")
        seen = mask.sum() if isinstance(mask, torch.Tensor) else torch.tensor(_labels(batch).numel())
        self.tokens_seen = seen.double() if self.tokens_seen is None else self.tokens_seen + seen.double()
        return loss if weight is None else loss * weight.to(loss.device)

    def eval_step(self, engine: Any, batch: Any) -> torch.Tensor:
        """The validation loss of a batch (mean over its labelled tokens)."""
        return self.nll(engine, batch, self.eval_meter)

    def step_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """mean_token_accuracy since the last logging point and num_tokens so far (collective)."""
        logs = self.meter.read(device)
        seen = (
            self.tokens_seen if self.tokens_seen is not None else torch.zeros((), dtype=torch.float64)
        ).to(device or "cpu")
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            seen = seen.clone()
            torch.distributed.all_reduce(seen)
        return {**logs, "num_tokens": float(seen.item())}

    def eval_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """mean_token_accuracy of the validation just run (logged as val_mean_token_accuracy)."""
        return self.eval_meter.read(device)

    def step_state(self) -> dict[str, Any]:
        """The accuracy window and this rank's token count."""
        seen = None if self.tokens_seen is None else self.tokens_seen.detach().cpu()
        return {"meter": self.meter.state_dict(), "tokens_seen": seen}

    def load_step_state(self, states: list[dict[str, Any]], device: torch.device | None = None) -> None:
        """The saved windows and token counts (summed: on another number of ranks every saved
        rank's state comes to one rank)."""
        self.meter.load_sums([s["meter"] for s in states if "meter" in s], device)
        counts = [s["tokens_seen"] for s in states if s.get("tokens_seen") is not None]
        self.tokens_seen = torch.stack(counts).sum().to(device or "cpu") if counts else None


def _labels(batch: Any) -> torch.Tensor:
    if not isinstance(batch, Mapping) or not isinstance(batch.get("labels"), torch.Tensor):
        kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ConfigError(
            f"SFT needs batches of token rows ({{input_ids, labels, ...}}), got {kind}: use data=hf_chat or "
            "data=hf_text"
        )
    return batch["labels"]
