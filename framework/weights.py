"""Removed after 0.1.0: it is `framework.backend.weights` now (importing this says so in one line)."""

raise ImportError(
    "framework.weights moved after 0.1.0: import from framework.backend.weights (consolidate, whole_shape, save_consolidated), or save_weights / load_weights from framework.export"
)
