"""Removed after 0.1.0: it is `framework.observe.metrics` now (importing this says so in one line)."""

raise ImportError(
    "framework.metrics moved after 0.1.0: import from framework.observe.metrics (Accuracy, Metrics, MetricSet, named_metrics)"
)
