"""A multi-layer perceptron classifier."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """`in_features -> hidden... -> num_classes`, ReLU between layers.

    `features` holds the hidden layers (so `features.2` names the second Linear), `head` the
    classifier; `pipeline_layers()` lists them flat for pipeline stages.
    """

    def __init__(
        self,
        in_features: int = 64,
        hidden: Sequence[int] = (128, 128),
        num_classes: int = 10,
        dropout: float = 0.0,
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of flat feature vectors."""
        return self.head(self.features(x.flatten(1)))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a flat list of layers, for splitting into pipeline stages."""
        return [nn.Flatten(1), *self.features, self.head]
