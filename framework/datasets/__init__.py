"""Data that ships with the project or is generated: nothing is downloaded."""

from framework.datasets.chars import chars
from framework.datasets.classification import Splits, digits, synthetic

__all__ = ["Splits", "chars", "digits", "synthetic"]
