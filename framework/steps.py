"""Removed after 0.1.0: it is `framework.engine.steps` now (importing this says so in one line)."""

raise ImportError(
    "framework.steps moved after 0.1.0: import from framework.engine.steps (default_train_step, default_eval_step, resolve_step, ...)"
)
