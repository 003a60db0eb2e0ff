"""A training method of your own, in your own module: supervised fine-tuning with label smoothing.

    python train.py model=hf_causal_lm model.path=DIR data=hf_chat \\
        +objective=custom objective.name=smoothed_sft.SmoothedSFT +objective.epsilon=0.1
    Engine(model, optimizer=..., train_step=SmoothedSFT(epsilon=0.1))

(run from the folder holding this file, or with it on PYTHONPATH). The loss of a labelled token is
(1 - epsilon) x its negative log-likelihood + epsilon x the mean over the vocabulary of
-log p: a mean over the labelled tokens of the whole global batch, exact on every layout because
`items` tells the framework what to count (each micro-batch's loss then gets its `weight`).
"""

from dataclasses import dataclass

import torch

from framework.errors import ConfigError
from framework.methods import Method


@dataclass
class SmoothedSFTConfig:
    epsilon: float = 0.1  # the share of each token's target spread over the whole vocabulary

    def __post_init__(self):
        if not 0.0 <= self.epsilon < 1.0:
            raise ConfigError.about("SmoothedSFT", "epsilon", self.epsilon, "must be in [0, 1)")


class SmoothedSFT(Method):
    Config = SmoothedSFTConfig

    def items(self, batch):
        """What the loss averages over: the labelled tokens (a causal LM: labels shifted by one)."""
        return (batch["labels"][:, 1:] != -100).sum().double()

    def __call__(self, engine, batch, weight=None):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = engine.model(**inputs, use_cache=False).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        counted = labels != -100
        log_p = torch.log_softmax(logits, -1)
        nll = -log_p.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        smooth = -log_p.mean(-1)
        eps = self.config.epsilon
        loss = (((1 - eps) * nll + eps * smooth) * counted).sum() / counted.sum().clamp_min(1)
        return loss if weight is None else loss * weight
