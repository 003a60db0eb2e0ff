"""A small LeNet-style CNN for 8x8 single-channel images (the digits data)."""

from __future__ import annotations

import torch
from torch import nn


class CNN(nn.Module):
    """conv(3x3) -> conv(3x3) -> pool -> MLP head; accepts flat 64-vectors or (B, 1, 8, 8) images."""

    def __init__(self, channels: int = 16, image_size: int = 8, num_classes: int = 10, hidden: int = 64):
        super().__init__()
        self.image_size = image_size
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(1),
        )
        flat = 2 * channels * (image_size // 2) ** 2
        self.head = nn.Sequential(nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        x = x.reshape(x.shape[0], 1, self.image_size, self.image_size)
        return self.head(self.features(x))
