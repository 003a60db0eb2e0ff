"""Data that ships with the project or is generated: nothing is downloaded."""

from framework.data.datasets.chars import chars
from framework.data.datasets.classification import Splits, as_splits, digits, synthetic
from framework.data.datasets.files import csv_classification

__all__ = ["Splits", "as_splits", "chars", "csv_classification", "digits", "synthetic"]
