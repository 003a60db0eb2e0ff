"""SimPO (Meng et al. 2024): preference tuning without a reference model, on the answers' mean
log-probabilities; TRL's `CPOTrainer` with `loss_type="simpo"` and `cpo_alpha=0`.

    python train.py ... data=hf_preference +objective=simpo objective.beta=2.0 objective.gamma=0.5
    Engine(model, optimizer=..., train_step=SimPO(beta=2.0, gamma=0.5))

A pair's loss is -log sigmoid(beta (avg_chosen - avg_rejected) - gamma), where avg is the mean
log-probability of an answer's tokens; the loss of a step is the mean over its pairs. Rewards
are beta x avg, as TRL logs them (`framework.methods.pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from framework.errors import ConfigError
from framework.methods.pairs import PairMethod, pair_metrics
from framework.methods.tokens import TokenScoring


@dataclass
class SimPOConfig(TokenScoring):
    """SimPO's options (TRL's `CPOConfig` names `gamma` `simpo_gamma`)."""

    beta: float = 2.0  # scale of the difference of the answers' mean log-probabilities
    gamma: float = 0.5  # the target reward margin

    def __post_init__(self) -> None:
        super().__post_init__()
        if not float(self.beta) > 0:
            raise ConfigError.about("SimPO", "beta", self.beta, "must be > 0")


class SimPO(PairMethod):
    """SimPO as a training step over pairs (see the module doc); no reference model."""

    name = "simpo"
    Config = SimPOConfig

    def loss(
        self, engine: Any, batch: dict[str, Any], weight: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The mean loss over the micro-batch's pairs and their metrics."""
        chosen, rejected = self.policy(engine, batch)
        avg_chosen, avg_rejected = chosen.average(), rejected.average()
        beta, gamma = float(self.config.beta), float(self.config.gamma)
        losses = -F.logsigmoid(beta * (avg_chosen - avg_rejected) - gamma)
        rewards = (beta * avg_chosen.detach(), beta * avg_rejected.detach())
        return losses.mean(), pair_metrics(chosen, rejected, *rewards, avg_chosen, avg_rejected)
