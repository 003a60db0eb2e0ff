"""Reference models: an MLP and a small CNN for 8x8 images (and a GPT that splits into pipeline stages)."""

from framework.models.cnn import CNN
from framework.models.gpt import GPT, LMLoss
from framework.models.mlp import MLP

__all__ = ["CNN", "GPT", "LMLoss", "MLP"]
