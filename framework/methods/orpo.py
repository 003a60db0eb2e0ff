"""ORPO (Hong et al. 2024): supervised fine-tuning on the chosen answers plus an odds-ratio
preference term, without a reference model; TRL's `ORPOTrainer`.

    python train.py ... data=hf_preference +objective=orpo objective.beta=0.1
    Engine(model, optimizer=..., train_step=ORPO(beta=0.1))

The loss of a step is the chosen answers' negative log-likelihood, a mean over all their tokens
in the global batch (exact on every layout: the framework counts those tokens over the global
batch first, `Method.items`), plus the mean over pairs of -beta log sigmoid(log_odds), where

    log_odds = (avg_c - avg_r) - (log(1 - exp(avg_c)) - log(1 - exp(avg_r)))

and avg is an answer's mean token log-probability. Rewards are beta x avg, as TRL logs them;
beside TRL's pair metrics (`framework.methods.pairs`): nll_loss, log_odds_ratio (the mean of
log sigmoid(log_odds)) and log_odds_chosen (the mean of log_odds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from framework.data.labels import IGNORE_INDEX
from framework.errors import ConfigError
from framework.methods.pairs import PAIR_METRICS, PairMethod, pair_metrics
from framework.methods.tokens import TokenScoring


@dataclass
class ORPOConfig(TokenScoring):
    """ORPO's options, named as TRL's `ORPOConfig` names them."""

    beta: float = 0.1  # lambda: the weight of the odds-ratio term against the NLL

    def __post_init__(self) -> None:
        super().__post_init__()
        if not float(self.beta) > 0:
            raise ConfigError.about("ORPO", "beta", self.beta, "must be > 0")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on the whole range."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class ORPO(PairMethod):
    """ORPO as a training step over pairs (see the module doc); no reference model."""

    name = "orpo"
    Config = ORPOConfig
    metric_names = (*PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def items(self, batch: dict[str, Any]) -> torch.Tensor:
        """The chosen answers' tokens the NLL averages over (a causal LM: labels shifted by one)."""
        return (batch["chosen_labels"][:, 1:] != IGNORE_INDEX).sum().to(torch.float64)

    def loss(
        self, engine: Any, batch: dict[str, Any], weight: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """NLL x `weight` (this micro-batch's share of the global batch's chosen tokens) + the mean
        odds-ratio term over its pairs, and their metrics."""
        chosen, rejected = self.policy(engine, batch)
        tokens = chosen.tokens.sum()
        nll = -chosen.logps.sum() / tokens.clamp_min(1)
        avg_chosen, avg_rejected = chosen.average(), rejected.average()
        log_odds = (avg_chosen - avg_rejected) - (log1mexp(avg_chosen) - log1mexp(avg_rejected))
        ratio = F.logsigmoid(log_odds)
        beta = float(self.config.beta)
        scaled = nll if weight is None else nll * weight.to(nll.device)
        loss = scaled - beta * ratio.mean()
        pairs = ratio.numel()
        metrics = pair_metrics(
            chosen,
            rejected,
            beta * avg_chosen.detach(),
            beta * avg_rejected.detach(),
            avg_chosen,
            avg_rejected,
        )
        metrics["nll_loss"] = (-chosen.logps.detach().sum(), tokens)
        metrics["log_odds_ratio"] = (ratio.detach().sum(), pairs)
        metrics["log_odds_chosen"] = (log_odds.detach().sum(), pairs)
        return loss, metrics
