"""DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023): preference tuning against a frozen
reference, as TRL's `DPOTrainer` computes it.

    python train.py model=hf_causal_lm model.path=DIR data=hf_preference +objective=dpo
    Engine(model, optimizer=..., train_step=DPO(beta=0.1)).fit(pairs, batch_size=8, collate_fn=pairs.collate_fn)

With s = beta x ((policy - reference) of the chosen - (policy - reference) of the rejected)
over the answers' log-probabilities (`framework.methods.pairs`), a pair's loss is

    sigmoid (DPO):  -(1 - label_smoothing) log sigmoid(s) - label_smoothing log sigmoid(-s)
    ipo:            (s / beta - 1 / (2 beta))^2      (log-probabilities averaged over answer tokens)

The reference log-probabilities come from, in this order: the batch (`reference_chosen_logps`
and `reference_rejected_logps`, computed once before training when `precompute_reference` is
on: the policy before its first step is the reference); the policy with its adapters off (a
`peft` model); a frozen copy (`framework.methods.reference`). Rewards are beta x (policy -
reference); the metrics are TRL's (`framework.methods.pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from framework.data.outputs import takes_use_cache
from framework.errors import ConfigError
from framework.methods.pairs import PairMethod, pair_metrics, pair_stats
from framework.methods.precompute import REFERENCE_KEYS, with_reference_logps
from framework.methods.reference import Reference
from framework.methods.tokens import TokenScoring

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DPOConfig(TokenScoring):
    """DPO's options, named as TRL's `DPOConfig` names them."""

    beta: float = 0.1  # strength of the pull towards the reference model (IPO's tau)
    loss_type: str = "sigmoid"  # sigmoid: DPO; ipo: IPO (log-probabilities averaged over answer tokens)
    label_smoothing: float = 0.0  # conservative DPO: the share of pairs assumed mislabelled (sigmoid only)
    # true: the reference's log-probabilities computed once before training, kept with the data
    # (no reference model is held while training)
    precompute_reference: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError.about("DPO", "loss_type", self.loss_type, f"one of {', '.join(LOSS_TYPES)}")
        if not float(self.beta) > 0:
            raise ConfigError.about("DPO", "beta", self.beta, "must be > 0")
        if not 0.0 <= float(self.label_smoothing) < 0.5:
            raise ConfigError.about("DPO", "label_smoothing", self.label_smoothing, "must be in [0, 0.5)")


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards) per pair, from sequence log-probabilities."""
    logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ConfigError(f"DPO(loss_type={loss_type!r}): one of {', '.join(LOSS_TYPES)}")
    chosen = beta * (policy_chosen - reference_chosen).detach()
    rejected = beta * (policy_rejected - reference_rejected).detach()
    return losses, chosen, rejected


class DPO(PairMethod):
    """DPO / IPO as a training step over pairs (see the module doc). `reference`: a frozen copy of
    the model made by the user; without one, an Engine taking this method makes it (not for a
    `peft` model, nor with `precompute_reference`)."""

    name = "dpo"
    Config = DPOConfig

    def __init__(
        self, config: DPOConfig | None = None, *, reference: torch.nn.Module | None = None, **options: Any
    ):
        super().__init__(config, **options)
        self.reference = Reference(reference)

    @property
    def average(self) -> bool:
        """IPO averages the answers' log-probabilities over their tokens."""
        return self.config.loss_type == "ipo"

    def attach(self, engine: Any) -> None:
        """The frozen reference copy, made now (before DeepSpeed) when it will be needed."""
        if not self.config.precompute_reference:
            self.reference.attach(
                engine.module,
                "DPO",
                "set precompute_reference=True (objective.precompute_reference=true), or train adapters "
                "(+adapter=lora)",
            )

    def weights_loaded(self, engine: Any) -> None:
        """The frozen reference starts from the loaded weights too (collective)."""
        self.reference.follow(engine.runtime)

    def prepare_data(self, engine: Any, data: Any, batch_size: int, collate_fn: Any) -> Any:
        """With `precompute_reference`: `data` with each pair's reference log-probabilities."""
        if not self.config.precompute_reference or data is None:
            return data
        return with_reference_logps(engine, data, batch_size, collate_fn, self.average, self.config.chunking)

    def loss(
        self, engine: Any, batch: dict[str, Any], weight: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The mean loss over the micro-batch's pairs and their metrics."""
        chosen, rejected = self.policy(engine, batch)
        policy = (chosen.average(), rejected.average()) if self.average else (chosen.logps, rejected.logps)
        reference = self.reference_logps(engine, batch)
        c = self.config
        losses, chosen_rewards, rejected_rewards = dpo_losses(
            *policy, *reference, c.beta, c.loss_type, c.label_smoothing
        )
        metrics = pair_metrics(chosen, rejected, chosen_rewards, rejected_rewards, *policy)
        return losses.mean(), metrics

    @torch.no_grad()
    def reference_logps(self, engine: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) log-probabilities (see the module doc)."""
        if all(key in batch for key in REFERENCE_KEYS):
            return batch[REFERENCE_KEYS[0]].float(), batch[REFERENCE_KEYS[1]].float()
        with self.reference.model(engine) as model:
            chosen, rejected = pair_stats(
                model,
                batch,
                engine.output_key,
                takes_use_cache(engine.module),
                chunk_size=self.config.chunking,
            )
        return (chosen.average(), rejected.average()) if self.average else (chosen.logps, rejected.logps)
